"""The reorganizer loop (read one consumer's assignment, pack it, publish) and the object that hosts it."""

from __future__ import annotations

import os
import time
import traceback

from knitkit.storage.backends.backend import (
    WHOLE,
    UnitBackend,
    UnitBytes,
    UnitSpec,
    UnitViews,
    check_backend,
)
from knitkit.storage.backends.lost import UnitsLostError
from knitkit.storage.delivery.layout_codec import RecordTemplate, encode_layout
from knitkit.storage.delivery.publication import Publisher, heartbeat_period, idle_period
from knitkit.storage.delivery.slot_ring import (
    ConsumerDiedError,
    RingClosedError,
    RingSpec,
    SlotRing,
)
from knitkit.storage.planning.copy_list import (
    ZEROS,
    Copy,
    MicroBatchCopies,
    reserve,
    run_copies,
    sources,
)
from knitkit.storage.planning.packing import PackTemplate, RowSpec, pack_template
from knitkit.storage.planning.plan import ConsumerPlan, EncoderRankPlan, MicroBatchPlan
from knitkit.types import MicroBatchLayout, UnitKey, UnitRead

# NOTE [ Copy lists ]: where the backend's units are bytes this process maps (``UnitBytes``:
# shared memory, memory), a reorganizer compiles each assignment, before its first slot, into
# one copy list per micro-batch: its layout and encoded record, the units it reads with what
# each must be (dtype, row shape, rows read), and ``(source, offset, slot offset, bytes)``
# copies that write every byte of the slot (unit rows; position ids, a generated loss mask, the
# sequence bounds and every padding or alignment byte from constant sources); then it maps
# every unit of the assignment in one backend call (``map_units``: NOTE [ Units mapped ahead ]
# in backends/shm.py). Per micro-batch what is left is the slot, the range of unit views
# (``views``: the reader brought up to date, each slab's size checked; a unit deleted since
# the map fails as a read does, and a unit missing at the map fails its own micro-batch, the
# ones before it published), one loop of slice assignments between memoryviews (each a
# memmove; ~25 for transfer.py's 2.4 MiB micro-batches) and one publication: no Python per
# field or per unit after a slot wait. Compiling the whole assignment first, not each
# micro-batch before its slot, is measured: after a slot wait the process's caches are cold
# and the same Python costs 2-5x (transfer.py, one backbone reorganizer, load ~10: compile
# 94-189 us and lookups 39-86 us per micro-batch compiled one at a time, against 31 and 10 us
# in a hot loop); an eager step's first micro-batch now waits for its assignment's compile
# (~0.2-0.5 ms at transfer.py's 6-7 micro-batches), a look-ahead step's compile runs a step
# ahead. transfer.py, back to back against 1cebb89 (4 pairs, load 5-18): reorganizers 0.0199 ->
# 0.0166, 0.0184 -> 0.0169, 0.0179 -> 0.0158 CPU s per step (a fourth pair's old run was an
# outlier), look-ahead -15 to -25%; eager within noise (0.0155 -> 0.0152, 0.0136 -> 0.0179,
# 0.0147 -> 0.0142). Tried and dropped (4 more pairs): compiling one micro-batch before each
# slot while slots are free and the rest when the next slot is held, or one after another
# while it is held (so an eager producer compiles instead of sleeping): the look-ahead gain
# shrank or vanished and eager did not improve (reorganizers 0.0163 -> 0.0173 and 0.0163 ->
# 0.0176, eager 0.0130 -> 0.0158 and 0.0122 -> 0.0153).
# Sources are units, not slab offsets: the copy lists stay valid whatever the store does, and
# the views are re-checked per micro-batch. Compiled here, not in the driver: the compile
# reads only the plan and the schema, but the driver is one process for every group of the
# job and plans on the eager path, while reorganizers compile in parallel, each for its own
# group (at DP32 x CP2 the driver would pay 64 groups' compiles per mini-batch, about as much
# as the planner itself). Measured (issue 31 stop 49, branch prod-shipped-copy-lists: the
# launcher compiled each plan that carries its schema and shipped the copy lists and records):
# transfer.py --quick, 2 ABBA rounds against ee9a537 at load 8-25, reorganizers 0.0212,
# 0.0176, 0.0169, 0.0179 -> 0.0139, 0.0160, 0.0160 (0.0240 beside a test run) CPU s per step,
# the driver 0.0014-0.0018 -> 0.0025-0.0029: the CPU moved onto the one driver thread (the hot
# compile costs most of what the cold one saves), so it stays here. Stage columns (strided
# rows) and backends that cannot expose bytes (disk, Ray) keep the template path (NOTE [ Pack
# templates ]), which the copy lists match byte for byte (tests/storage/test_reorg_copy_lists.py).
# Measured in one process (transfer.py's micro-batches, thread time, caches evicted before
# each slot as a slot wait leaves them, medians of 8 passes, load ~10): 486 -> 394 us per
# micro-batch (~190 us of it memcpy), and in transfer.py, back to back against 1cebb89:
# benchmarks/README.md (transfer).

# NOTE [ Fill time ]: a reorganizer counts, beside each micro-batch's bytes, the thread CPU its
# fill took: the copy list's loop (one memmove per copy, ~25 for transfer.py's micro-batches) or
# the template path's reads into the slot (the backend's ``read_many``, a disk's ``preadv``).
# Every delivered byte has to be written into its slot once, so that is the part of a
# reorganizer's CPU the delivery cannot shed; what else it spends (compiling, views, slot waits
# and wakes, publication) is what knitkit can still cut. The count is a ring word
# (``SlotRing.fill_s``, ``knitkit/delivery/reorganizer_fill_s``), so a launcher reads it while
# the child runs; benchmarks/transfer.py sets it against the run's CPU (the floor under
# ``knitkit.delivered_fraction_of_memcpy``). Two thread-clock reads per micro-batch (~0.25 us
# each here) against its ~300-800 us of CPU; the fill's figure includes the copy loop's Python
# (a slice assignment per copy).


class Reorganizer:
    """Serves one (DP, CP) group (or one encoder rank): reads only its ranges, publishes in order.

    It runs in any process that can read ``backend`` and map the publisher's ring: a spawned
    process (``ReorganizerProcess``), a Ray actor, or a test's own process. Each micro-batch is
    laid out from the plan, then read straight into its ring slot (no staging copy) and
    published as soon as it is complete, so consumers start on micro-batch 0 while later ones
    are still being read; the ring's slot count bounds the look-ahead.
    """

    def __init__(self, backend: UnitBackend, publisher: Publisher) -> None:
        self.backend = backend
        self.publisher = publisher
        self._schema: dict[str, RowSpec] = {}
        self._map_units = backend.map_units if isinstance(backend, UnitBytes) else None
        """Where units are bytes this process maps: their views (NOTE [ Copy lists ])."""
        self._packers: dict[object, tuple[PackTemplate, RecordTemplate]] = {}
        """Field sets -> their templates under the current schema, kept across assignments
        while the schema holds (NOTE [ Pack templates ])."""

    def deliver(self, minibatch_id: str, plan: ConsumerPlan | EncoderRankPlan) -> int:
        """Publish every micro-batch of ``plan`` in consumption order; returns how many."""
        count = len(plan.micro_batches)
        if isinstance(plan, ConsumerPlan) and self._learn_schema(plan):
            self._packers.clear()  # a field's dtype or row shape changed: its templates too
        extras: list[dict[str, int | float | str]] = [
            {"minibatch_id": minibatch_id, "micro_batch": index, "num_micro_batches": count}
            for index in range(count)
        ]
        if self._map_units is not None and (  # NOTE [ Copy lists ]
            isinstance(plan, EncoderRankPlan) or not any(mb.columns for mb in plan.micro_batches)
        ):
            self._publish_copies(*self._compile(plan, extras))
            return count
        for index in range(count):
            if isinstance(plan, ConsumerPlan):
                self._publish_backbone(plan.micro_batches[index], extras[index])
            else:
                self._publish_encoder(plan.micro_batches[index], extras[index])
        return count

    def _compile(
        self, plan: ConsumerPlan | EncoderRankPlan, extras: list[dict[str, int | float | str]]
    ) -> tuple[list[MicroBatchCopies], UnitViews]:
        """Every micro-batch of ``plan`` as a copy list, and every unit they read mapped, in
        one pass before the first slot (NOTE [ Copy lists ])."""
        if isinstance(plan, EncoderRankPlan):
            pairs = zip(plan.micro_batches, extras, strict=True)
            compiled = [self._encoder_copies(units, extra) for units, extra in pairs]
        else:
            pairs_ = zip(plan.micro_batches, extras, strict=True)
            compiled = [self._backbone_copies(mb, extra) for mb, extra in pairs_]
        assert self._map_units is not None
        keys = [key for copies in compiled for key in copies.units]
        needs = [need for copies in compiled for need in copies.needs]
        return compiled, self._map_units(keys, needs)

    def _backbone_copies(
        self, micro_batch: MicroBatchPlan, extra: dict[str, int | float | str]
    ) -> MicroBatchCopies:
        """A backbone micro-batch as a copy list (its pack template's, NOTE [ Pack templates ])."""
        template, record = self._packer(micro_batch)
        shaped = template.shape(micro_batch, extra)
        units, needs, copies, constants, moved = template.copy_list(micro_batch, shaped)
        layout = shaped.layout
        record_bytes = record.encode(layout, shaped.offsets, shaped.lead)
        return MicroBatchCopies(layout, record_bytes, units, needs, copies, constants, moved)

    def _encoder_copies(
        self, units: tuple[UnitKey, ...], extra: dict[str, int | float | str]
    ) -> MicroBatchCopies:
        """An encoder micro-batch (each unique unit whole, ``MicroBatchLayout.of_units``) as a
        copy list: one copy per unit, zeros between them."""
        specs = {k: (spec.dtype, spec.shape) for k in units for spec in (self.backend.spec(k),)}
        layout = MicroBatchLayout.of_units(specs, extra=extra)
        copies: list[Copy] = []
        end = 0
        for index, view in enumerate(layout.fields):
            size = UnitSpec(view.dtype, view.shape).nbytes
            if view.offset > end:
                copies.append((ZEROS, 0, end, view.offset - end))
            copies.append((index, 0, view.offset, size))
            end = view.offset + size
        if layout.nbytes > end:
            copies.append((ZEROS, 0, end, layout.nbytes - end))
        reserve(ZEROS, max((c[3] for c in copies if c[0] == ZEROS), default=0))
        needs = tuple((dtype, shape, WHOLE) for dtype, shape in specs.values())
        moved = sum(c[3] for c in copies if c[0] >= 0)
        record = encode_layout(layout)
        return MicroBatchCopies(layout, record, units, needs, tuple(copies), b"", moved)

    def _publish_copies(self, compiled: list[MicroBatchCopies], units: UnitViews) -> None:
        """The compiled micro-batches in order: per micro-batch a slot, its units' views (as
        they are now: NOTE [ Units mapped ahead ] in backends/shm.py), the copies, one
        publication."""
        publisher = self.publisher
        ring = publisher.ring
        clock = time.thread_time_ns
        start = 0
        for copies in compiled:
            stop = start + len(copies.units)
            slot = publisher.acquire(copies.layout.nbytes)
            views = units.views(start, stop, copies.unit_bytes)
            began = clock()  # NOTE [ Fill time ]
            run_copies(copies.copies, sources(views, copies.constants), slot)
            ring.count_fill(copies.unit_bytes, clock() - began)
            publisher.publish(copies.layout, copies.record)
            start = stop

    def _packer(self, micro_batch: MicroBatchPlan) -> tuple[PackTemplate, RecordTemplate]:
        """The pack and record templates of ``micro_batch``'s field set (NOTE [ Pack templates ])."""
        key = (micro_batch.token_fields, micro_batch.scalar_fields, micro_batch.columns)
        packer = self._packers.get(key)
        if packer is None:
            template = pack_template(micro_batch, self._schema)
            record = RecordTemplate(template.names, template.dtypes, template.trailing)
            packer = self._packers[key] = (template, record)
        return packer

    def _publish_backbone(
        self, micro_batch: MicroBatchPlan, extra: dict[str, int | float | str]
    ) -> None:
        template, record = self._packer(micro_batch)
        shaped = template.shape(micro_batch, extra)
        slot = self.publisher.acquire(shaped.layout.nbytes)
        before, began = self.backend.bytes_read, time.thread_time_ns()
        template.fill(micro_batch, shaped, slot, self.backend.read_many)
        layout = shaped.layout
        self._publish(layout, before, began, record.encode(layout, shaped.offsets, shaped.lead))

    def _publish_encoder(
        self, units: tuple[UnitKey, ...], extra: dict[str, int | float | str]
    ) -> None:
        """An encoder micro-batch: each unique multimodal unit whole (``MicroBatchLayout.of_units``)."""
        specs = {k: (spec.dtype, spec.shape) for k in units for spec in (self.backend.spec(k),)}
        layout = MicroBatchLayout.of_units(specs, extra=extra)
        slot = self.publisher.acquire(layout.nbytes)
        views = layout.unit_views(slot)
        before, began = self.backend.bytes_read, time.thread_time_ns()
        self.backend.read_many([UnitRead(key) for key in views], list(views.values()))
        layout.clear_padding(slot)
        self._publish(layout, before, began)

    def _publish(
        self,
        layout: MicroBatchLayout,
        bytes_read_before: int,
        fill_began_ns: int,
        record: bytes | None = None,
    ) -> None:
        """Count the bytes read for this micro-batch and its fill's CPU since ``fill_began_ns``
        (NOTE [ Fill time ]), then publish it (``record``: its layout record, already encoded):
        a consumer that sees a micro-batch also sees the ring's counts include it."""
        fill_ns = time.thread_time_ns() - fill_began_ns
        self.publisher.ring.count_fill(self.backend.bytes_read - bytes_read_before, fill_ns)
        self.publisher.publish(layout, record)

    def _learn_schema(self, plan: ConsumerPlan) -> bool:
        """dtype and row shape of every field the plan packs; whether a field known before
        changed (new fields only add templates).

        From the plan's own schema (``TrajectoryStore.register`` fills it in), else from the
        first of this consumer's trajectories that has the field, else from an earlier
        mini-batch. An idle DP rank has no trajectories to learn from, so without a schema its
        (empty) micro-batches cannot be laid out: that is an error naming the fields.
        """
        given = plan.row_specs
        changed = any(self._schema.get(name, spec) != spec for name, spec in given.items())
        self._schema.update(given)
        for micro_batch in plan.micro_batches:
            for name in (*micro_batch.token_fields, *micro_batch.scalar_fields):
                if name in self._schema or not micro_batch.sequences:
                    continue
                spec = self.backend.spec(UnitKey(micro_batch.sequences[0].trajectory_id, name))
                row = spec.shape[1:] if name in micro_batch.token_fields else spec.shape
                self._schema[name] = (spec.dtype, row)
        needed = {f for mb in plan.micro_batches for f in (*mb.token_fields, *mb.scalar_fields)}
        missing = sorted(needed - set(self._schema))
        if missing:
            raise KeyError(
                f"consumer {plan.name}: no dtype/shape for fields {missing} and no trajectory to "
                "learn them from; submit the plan returned by TrajectoryStore.register (it "
                "carries every field's schema)"
            )
        return changed


class ReorganizerHost:
    """One reorganizer as a host process runs it: the producer side of its ring and the loop.

    Hosts (``ReorganizerProcess``'s spawned child, ``knitkit.integration.ray``'s actor) only
    call ``deliver`` per assignment, then ``finish`` or ``fail``, and ``close``. The host keeps
    the publication protocol's promises to consumers (NOTE [ Micro-batch publication protocol ]):
    liveness beats only with progress while an assignment runs, and whatever ends an assignment
    early is written to the ring (FAILED and the reason) before it propagates, so consumers
    raise instead of waiting. ``owns_ring=False`` attaches to a ring its launcher created (and
    will unlink); ``owns_ring=True`` creates it and unlinks it in ``close``. The backend stays
    the caller's: ``close`` never closes it. A backend may offer two optional hooks:
    ``resolve(keys)``, called once per assignment before its reads (``RayBackend``: one
    directory call), and ``release(keys)`` after it.
    """

    def __init__(
        self,
        backend: UnitBackend,
        spec: RingSpec,
        *,
        owns_ring: bool = False,
        role: str = "reorganizer",
        beat_thread: bool = True,
        liveness_timeout_s: float | None = None,
    ) -> None:
        """``role`` names the producer in the errors it writes to the ring; ``beat_thread=False``:
        the host's loop calls ``beat_idle`` every ``heartbeat_s`` while idle instead of a thread
        (see NOTE [ Micro-batch publication protocol ]); ``liveness_timeout_s``: the shortest
        ``liveness_timeout_s`` of the ring's consumers, which paces the heartbeat (NOTE
        [ Heartbeat period ]; ``None``: one beat per ``HEARTBEAT_S``)."""
        check_backend(backend)  # a wrapper handed over without a store fails here, named
        self.spec = spec
        self.role = role
        self.backend = backend
        self._ring = SlotRing.create(spec) if owns_ring else SlotRing.attach(spec)
        self._owns_ring = owns_ring
        self._publisher = Publisher(self._ring)
        try:
            self._publisher.start(
                beat_thread=beat_thread, heartbeat_s=heartbeat_period(liveness_timeout_s)
            )
        except BaseException:
            self.close()
            raise
        self._reorganizer = Reorganizer(backend, self._publisher)
        self.idle_s = idle_period(liveness_timeout_s)
        """How often a host whose idle wait sees its owner's death and stop at once (a
        ``ReorganizerProcess``'s child) beats while idle (NOTE [ Heartbeat period ])."""

    @property
    def bytes_read(self) -> int:
        """Payload bytes read from the backend for this ring so far."""
        return self._ring.bytes_read

    @property
    def fill_s(self) -> float:
        """Thread CPU seconds spent writing micro-batches into slots so far (NOTE [ Fill time ])."""
        return self._ring.fill_s

    @property
    def published(self) -> int:
        """Micro-batches published into this ring so far."""
        return self._ring.published

    def consumers_attached(self) -> int:
        """How many of the ring's consumers are attached now (NOTE [ Ring role locks ])."""
        return sum(self._ring.consumer_attached(c) for c in range(self.spec.num_consumers))

    @property
    def heartbeat_s(self) -> float:
        """How often the host beats while it waits (NOTE [ Heartbeat period ])."""
        return self._publisher.heartbeat_s

    @property
    def abandoned(self) -> bool:
        """The ring's owner asked the producer to stop, or died: an idle host should leave."""
        return self._ring.stop_requested or not self._ring.owner_alive

    def deliver(self, minibatch_id: str, plan: ConsumerPlan | EncoderRankPlan) -> int:
        """Read, pack and publish every micro-batch of ``plan`` in order; returns how many.

        Raises what stopped it (``RingClosedError``: the owner stopped the ring;
        ``ConsumerDiedError``: a consumer died holding a slot; anything the backend raised)
        after writing it to the ring for the consumers.
        """
        resolve = getattr(self.backend, "resolve", None)
        release = getattr(self.backend, "release", None)
        keys = [read.key for read in plan.reads()] if resolve or release else []
        try:
            with self._publisher.busy():  # see NOTE [ Micro-batch publication protocol ]: liveness
                if resolve is not None:
                    resolve(keys)
                return self._reorganizer.deliver(minibatch_id, plan)
        except (RingClosedError, ConsumerDiedError) as error:
            self.fail(str(error))
            raise
        except UnitsLostError as error:  # keys first: the ring keeps 4096 bytes of the text
            self.fail(f"{error}\n{self.role} pid {os.getpid()}:\n{traceback.format_exc()}")
            raise
        except BaseException:
            self.fail(f"{self.role} pid {os.getpid()} failed:\n{traceback.format_exc()}")
            raise
        finally:
            if release is not None:
                release(keys)

    def finish(self) -> None:
        """No more assignments: consumers stop after the last published micro-batch (a ring
        that already failed keeps its error)."""
        if not self._ring.failed:
            self._publisher.finish()

    def fail(self, message: str) -> None:
        """End the ring with an error: consumers raise ``ReorganizerError`` with ``message`` (a
        ring that already failed keeps its first error)."""
        if not self._ring.failed:
            self._publisher.fail(message)

    def beat_idle(self) -> None:
        """Say "alive, waiting for work" (a host built with ``beat_thread=False``)."""
        self._publisher.beat_idle()

    def stop(self) -> None:
        """Make a ``deliver`` blocked on a full ring give up (the owner's STOP; any thread)."""
        self._ring.request_stop()

    def close(self) -> None:
        """Stop the heartbeat and unmap the ring; unlink it if this host owns it."""
        self._publisher.close()
        if self._owns_ring:
            self._ring.unlink()
