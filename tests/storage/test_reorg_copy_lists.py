"""A reorganizer compiles each assignment into copy lists (NOTE [ Copy lists ]): the slot it
publishes is the straightforward packer's bytes, and per micro-batch it runs no Python per field."""

from __future__ import annotations

import pickle
import sys
import threading
from types import FrameType

import numpy as np
import pytest
from delivery_payloads import fill_backend, make_metas, payload, plan_for

from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.consumer import MicroBatchConsumer, ReorganizerError
from knitkit.storage.delivery.layout_codec import encode_layout
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer import Reorganizer, ReorganizerHost
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.storage.planning import pack
from knitkit.storage.planning.plan import ConsumerPlan, Topology
from knitkit.types import MicroBatchLayout, UnitKey

SCHEMA = {
    "tokens": ("int32", ()),
    "logprobs": ("float32", ()),
    "routing": ("uint8", (3, 2)),
    "reward": ("float32", ()),
}
LENGTHS = [37, 5, 91, 12, 60, 23, 1, 44]


class _Slots:
    """A publisher stand-in that hands out one reused, dirty buffer and keeps what it publishes."""

    def __init__(self) -> None:
        self.buffer = np.full(1 << 18, 0xAB, np.uint8)
        self.published: list[tuple[bytes, bytes]] = []

    def acquire(self, nbytes: int) -> memoryview:
        self.buffer[:] = 0xAB  # whatever the slot held before must not show
        self.nbytes = nbytes
        return memoryview(self.buffer)[:nbytes]

    def publish(self, layout: MicroBatchLayout, record: bytes | None = None) -> int:
        record = encode_layout(layout) if record is None else record  # as the ring does
        self.published.append((self.buffer[: self.nbytes].tobytes(), record))
        return len(self.published) - 1

    @property
    def ring(self) -> _Slots:
        return self

    def count_fill(self, nbytes: int, cpu_ns: int) -> None:
        self.bytes_read = getattr(self, "bytes_read", 0) + nbytes


@pytest.mark.parametrize("kind", ["memory", "shm"])
@pytest.mark.parametrize(("cp", "stored_mask"), [(1, False), (2, False), (2, True)])
def test_a_copy_list_packs_what_the_straightforward_packer_packs(
    kind: str, cp: int, stored_mask: bool
) -> None:
    """Every micro-batch of a DP2 x CP plan (padding rows, CP chunks, a scalar field, a loss mask
    generated or stored), compiled and run into a slot that held other bytes, is ``pack``'s
    buffer byte for byte and its record is ``encode_layout`` of ``pack``'s layout; the ring's
    byte count is the units' bytes read. An encoder rank's micro-batches likewise."""
    metas = make_metas(LENGTHS)
    owner = MemoryBackend() if kind == "memory" else SharedMemoryBackend(slab_bytes=1 << 20)
    try:
        fill_backend(owner, metas)
        schema = dict(SCHEMA)
        if stored_mask:
            schema["loss_mask"] = ("float32", ())
            for index, meta in enumerate(metas):
                mask = (payload(index, meta.num_tokens)["tokens"] % 3).astype(np.float32)
                owner.put(UnitKey(meta.trajectory_id, "loss_mask"), mask)
        backend = owner if kind == "memory" else pickle.loads(pickle.dumps(owner))
        plan = plan_for(metas, Topology(dp=2, cp=cp), 64, "mb")
        if stored_mask:
            plan = plan.with_fields(("tokens", "logprobs", "routing", "reward"))
            plan = _with_mask(plan)
        plan = plan.with_schema(schema)
        for consumer in plan.consumers:
            slots = _Slots()
            reorganizer = Reorganizer(backend, slots)  # type: ignore[arg-type]
            count = reorganizer.deliver("mb", consumer)
            assert count == len(slots.published) == len(consumer.micro_batches)
            for micro_batch, (got, record) in zip(
                consumer.micro_batches, slots.published, strict=True
            ):
                extra = {"minibatch_id": "mb", "micro_batch": micro_batch.index}
                layout, want = pack(
                    micro_batch, schema, lambda r, out: backend.read(r.key, r.ranges, out=out)
                )
                assert got == want.tobytes(), f"{consumer.name} micro-batch {micro_batch.index}"
                layout = type(layout)(
                    layout.fields,
                    layout.nbytes,
                    layout.cu_seqlens_padded,
                    layout.trajectory_ids,
                    (),
                    {**layout.extra, **extra, "num_micro_batches": count},
                )
                assert record == encode_layout(layout)
            want_read = sum(r.nbytes for r in _reads(backend, consumer))
            assert slots.bytes_read == want_read
        images = {
            UnitKey(f"img{i}", "image"): np.arange(i * 7 + 3, dtype=np.float32) for i in (1, 2, 3)
        }
        for key, array in images.items():
            owner.put(key, array)
        if kind == "shm":
            backend = pickle.loads(pickle.dumps(owner))
        from knitkit.storage.planning.plan import EncoderRankPlan

        slots = _Slots()
        Reorganizer(backend, slots).deliver("mb", EncoderRankPlan("vision", 0, (tuple(images),)))  # type: ignore[arg-type]
        got, _ = slots.published[0]
        for view, array in zip(
            _encoder_fields(slots.published[0][1]), images.values(), strict=True
        ):
            assert got[view.offset : view.offset + array.nbytes] == array.tobytes()
        assert slots.bytes_read == sum(a.nbytes for a in images.values())
    finally:
        owner.close()


def _with_mask(plan):  # type: ignore[no-untyped-def]
    """``plan`` with ``loss_mask`` read as a stored per-token field."""
    from dataclasses import replace

    consumers = tuple(
        replace(
            c,
            micro_batches=tuple(
                replace(mb, token_fields=(*mb.token_fields, "loss_mask")) for mb in c.micro_batches
            ),
        )
        for c in plan.consumers
    )
    return replace(plan, consumers=consumers)


def _reads(backend, consumer: ConsumerPlan):  # type: ignore[no-untyped-def]
    return [backend.read(r.key, r.ranges) for r in consumer.reads()]


def _encoder_fields(record: bytes):  # type: ignore[no-untyped-def]
    from knitkit.storage.delivery.layout_codec import decode_layout

    return decode_layout(record, 1 << 18).fields


def _calls_per_micro_batch(token_fields: tuple[str, ...]) -> tuple[float, float]:
    """Python function calls a reorganizer makes per published micro-batch from its first slot
    on (the slot waits, lookups, copies and publications; not the compile before the first
    slot), for a plan packing ``token_fields``; and the unit reads per micro-batch."""
    metas = make_metas([40, 33, 51, 29, 47, 38, 35, 44])
    owner = SharedMemoryBackend(slab_bytes=1 << 20)
    names = [f"f{i}" for i in range(len(token_fields))]
    for index, meta in enumerate(metas):
        for name in names:
            owner.put(UnitKey(meta.trajectory_id, name), np.full(meta.num_tokens, index, np.int32))
    reader = pickle.loads(pickle.dumps(owner))
    from knitkit.storage.planning.planner import PlannerConfig, plan_minibatch

    config = PlannerConfig(
        token_fields=tuple(names), scalar_fields=(), max_tokens_per_micro_batch=64
    )
    plan = plan_minibatch(metas, Topology(dp=1, cp=2), config, minibatch_id="mb")
    plan = plan.with_schema({name: ("int32", ()) for name in names})
    consumer = plan.consumer(0, 0)
    # two consumers, as transfer.py's TP2 (none attached: 32 slots hold the whole assignment)
    spec = RingSpec.new(num_slots=32, slot_bytes=1 << 16, num_consumers=2)
    host = ReorganizerHost(reader, spec, owns_ring=True, beat_thread=False)
    calls = 0
    slots = False

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls, slots
        if event == "call":
            slots = slots or frame.f_code.co_name == "acquire"
            calls += slots

    try:
        sys.setprofile(count)
        try:
            host.deliver("mb", consumer)
        finally:
            sys.setprofile(None)
        count = len(consumer.micro_batches)
        return calls / count, len(consumer.reads()) / count
    finally:
        host.close()
        reader.close()
        owner.close()


def test_a_micro_batch_runs_no_python_per_unit_after_its_slot() -> None:
    """From its first slot on, the reorganizer's Python calls per micro-batch do not grow with
    its unit reads: the whole assignment was compiled and its units mapped before that slot
    (NOTE [ Copy lists ]), so a micro-batch is a slot, its units' views (NOTE [ Units mapped
    ahead ] in backends/shm.py), one loop of copies and a publication. On 1cebb89 each
    micro-batch was compiled after the previous one's publication and each of its units looked
    up after its slot: 102 calls per micro-batch with 2 fields and 143 with 8 (5.3 and 21.3
    unit reads), against 30 and 30 here; and at two consumers the slot's wait, views and
    publication take 23 calls, not 37 as at d1b4542 (a wait's schedule built per slot, two
    frames per consumer to find the lagging one, a frame per consumer and per store to decide on
    a wake: NOTE [ Slot path in few calls ] in publication.py)."""
    few, few_reads = _calls_per_micro_batch(("a",) * 2)
    many, many_reads = _calls_per_micro_batch(("a",) * 8)
    assert many_reads > few_reads + 10
    assert many - few <= 2 and many <= 24, (
        f"{few:.1f} calls per micro-batch with 2 fields, {many:.1f} with 8 "
        f"({few_reads:.1f} and {many_reads:.1f} unit reads)"
    )


def test_a_unit_deleted_after_its_assignment_compiled_is_not_read() -> None:
    """A unit deleted (and its extent reused by a new unit) after the assignment was compiled
    but before its micro-batch is packed: the reorganizer resolves units per micro-batch, so its
    consumer raises ``ReorganizerError`` naming the unit instead of receiving the new unit's
    bytes; the micro-batches before it arrive intact."""
    metas = make_metas([30, 30, 30, 30])
    owner = SharedMemoryBackend(slab_bytes=1 << 20)
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 16, num_consumers=1)
    ring = SlotRing.create(spec)
    try:
        fill_backend(owner, metas)
        reader = pickle.loads(pickle.dumps(owner))
        plan = plan_for(metas, Topology(dp=1), 32, "mb")
        consumer = plan.consumer(0, 0)
        assert len(consumer.micro_batches) >= 2
        victim = consumer.micro_batches[-1].sequences[0].trajectory_id
        publisher = Publisher(SlotRing.attach(spec))
        publisher.start()
        reorganizer = Reorganizer(reader, publisher)
        failed: list[BaseException] = []

        def produce() -> None:
            try:
                reorganizer.deliver("mb", consumer)
            except BaseException as error:  # written to the ring as a host would
                publisher.fail(str(error))
                failed.append(error)

        with MicroBatchConsumer(spec, 0) as rank:
            thread = threading.Thread(target=produce)
            thread.start()
            first = rank.next_micro_batch(timeout_s=30)  # the producer now waits for this slot
            key = UnitKey(victim, "routing")
            owner.delete(key)
            owner.put(UnitKey("intruder", "routing"), np.zeros((30, 3, 2), np.uint8))
            first.release()
            with pytest.raises(ReorganizerError, match=f"{victim}/routing"):
                for _ in consumer.micro_batches[1:]:
                    rank.next_micro_batch(timeout_s=30).release()
            thread.join(30)
        assert failed and isinstance(failed[0], KeyError)
        publisher.close()
        reader.close()
    finally:
        ring.close()
        ring.unlink()
        owner.close()


@pytest.mark.parametrize("kind", ["memory", "shm"])
def test_a_unit_missing_when_its_assignment_is_mapped_fails_its_own_micro_batch(
    kind: str,
) -> None:
    """Units are mapped for the whole assignment before its first slot, but a unit that is
    already gone then fails only the micro-batch that reads it, with ``read``'s ``KeyError``
    naming it: the micro-batches before it are published intact (NOTE [ Units mapped ahead ]
    in backends/shm.py)."""
    metas = make_metas([30, 30, 30, 30])
    owner = MemoryBackend() if kind == "memory" else SharedMemoryBackend(slab_bytes=1 << 20)
    try:
        fill_backend(owner, metas)
        plan = plan_for(metas, Topology(dp=1), 32, "mb").with_schema(SCHEMA)
        consumer = plan.consumer(0, 0)
        victim = consumer.micro_batches[-1].sequences[0].trajectory_id
        owner.delete(UnitKey(victim, "logprobs"))
        backend = owner if kind == "memory" else pickle.loads(pickle.dumps(owner))
        slots = _Slots()
        with pytest.raises(KeyError, match=f"{victim}/logprobs"):
            Reorganizer(backend, slots).deliver("mb", consumer)  # type: ignore[arg-type]
        assert len(slots.published) == len(consumer.micro_batches) - 1 >= 2
        for micro_batch, (got, _) in zip(consumer.micro_batches, slots.published, strict=False):
            _, want = pack(
                micro_batch, SCHEMA, lambda r, out: backend.read(r.key, r.ranges, out=out)
            )
            assert got == want.tobytes()
    finally:
        owner.close()


def test_units_mapped_on_a_slab_that_shrank_since_raise_units_lost() -> None:
    """A slab truncated after its units were mapped: their views are not handed out (reading
    them would be a SIGBUS); ``UnitsLostError`` names the units of the range asked for (NOTE
    [ Shrunk segments ] in backends/slab.py)."""
    import os

    from knitkit.storage.backends import WHOLE, UnitsLostError

    owner = SharedMemoryBackend(slab_bytes=1 << 20)
    try:
        keys = [UnitKey(f"t{i}", "reward") for i in range(3)]
        for key in keys:
            owner.put(key, np.ones((), np.float32))
        reader = pickle.loads(pickle.dumps(owner))
        mapped = reader.map_units(keys, [("float32", (), WHOLE)] * 3)
        assert bytes(mapped.views(0, 1, 4)[0]) == np.ones((), np.float32).tobytes()
        os.truncate(owner.paths[0], 4096)
        with pytest.raises(UnitsLostError, match="truncated") as caught:
            mapped.views(1, 3, 8)
        assert list(caught.value.keys) == keys[1:]
        reader.close()
    finally:
        owner.close()
