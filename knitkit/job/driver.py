"""The driver: trajectories in, admitted mini-batches planned once and served pass by pass, write-backs stored."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from knitkit.admission import AdmissionController, Shortfall
from knitkit.job import checkpoint_state
from knitkit.job.checkpoint_state import DriverState, Pending, Resumed, Shape, Snapshot
from knitkit.job.collect import Collector
from knitkit.job.control import ControlLayout, ControlPlane, LocalControl, NodeAware
from knitkit.job.core import JobCore
from knitkit.job.errors import NodeFailedError
from knitkit.job.intake import Intake
from knitkit.job.ledger import MiniBatchLedger, Progress
from knitkit.job.passes import Pass, check_passes
from knitkit.job.pool import ProcessPool, ReorganizerPool
from knitkit.job.recovery import RESTARTS_KEY, RestartingPool
from knitkit.job.serving import IDLE_S, Scheduler
from knitkit.job.spec import PREFETCH_DEPTH, RankSpec, data_rings, encoder_rank_name, group_name
from knitkit.metrics import MetricsObserver, merge
from knitkit.storage import (
    EncoderTopology,
    PlacedTrajectory,
    PlannerConfig,
    RingSpec,
    SharedMemoryBackend,
    Topology,
    Trajectory,
    TrajectoryStore,
)
from knitkit.types import TrajectoryMeta

_T = TypeVar("_T")

# NOTE [ Driver threads ]:
# Lifecycle table: docs/lifecycle.md. A driver runs one scheduler thread (``serving.py``) and one
# collector thread per (DP, CP) group (``collect.py``); callers' threads only write trajectories
# and read state. Every piece of state lives under ONE lock (``JobCore.lock``: the store and the
# admission controller are not thread-safe):
# - ``write`` (any caller thread) stores, reports, admits, plans and registers under the lock
#   (``intake.py``): admission is irrevocable, so a mini-batch is planned once, at once, in
#   admission order.
# - The scheduler serves each mini-batch's passes in order, to each group once the group's
#   reads are produced (NOTE [ Next pass per group ] in serving.py): it waits (condition
#   variable, woken by collectors), then, outside the lock, queues the assignments on the
#   reorganizers and, with a mini-batch's first pass, publishes its schedule record. One
#   thread doing both keeps every ring's order equal to the schedule's, which keeps every rank on
#   the same pass of the same mini-batch (their collectives match). It also pushes released
#   mini-batches' figures to the observer (one thread, steps in order), checks the pool's
#   health between waits and frees the units of groups that ended a mini-batch once their
#   reorganizers published it (NOTE [ Reorganizer restart ] in recovery.py).
# - A collector drains its group's write-back ring, stores outputs and records pass ends. It
#   never waits for the scheduler: a writer rank may run a whole pass ahead of it, and a full
#   write-back ring and a full schedule ring must not wait for each other.
# A failure anywhere is recorded once (``JobCore.fail``): every waiting call raises it, the
# schedule fails with its message so every rank raises ``DriverFailedError``, and ``close``
# stops everything in a bounded time (``stop`` releases the scheduler from a full ring, closing
# their write-back sources releases the collectors). The schedule and write-back channels are a
# ``ControlPlane``'s (NOTE [ Control across nodes ] in control.py): rings on this node, or relays
# on every node that hosts ranks.


# NOTE [ Data ring slots ]: a rank gives a pass's last two leases back only when its pass-end
# thread closes the pass's iterator (the one its loop held last, and the one before, retired
# after the prefetch thread ended), after the pass's write-back records (NOTE [ Asynchronous
# pass ends ] in completion.py). With 2 slots per data ring a reorganizer could publish
# nothing of the next pass until then, and that thread shares the cores and the GIL with the
# loop: traced in ``benchmarks/grpo_step.py --quick`` at b870bfe (load 17-21), the close ran
# 1-69 ms after a pass's end and the next pass's first micro-batch waited for it (up to 88 ms
# on a step). So ``num_slots`` defaults to the ranks' default prefetch depth + 2
# (``PREFETCH_DEPTH``): the next pass's first ``depth`` micro-batches are published while the
# finished pass still holds its two. A ring's memory is ``num_slots x slot_bytes`` of shared
# memory (touched only as far as micro-batches fill each slot). A rank whose passes run
# inline (CPU, no ``convert``: NOTE [ Passes inline ] in rank.py) gives its one last lease back
# at ``done``.


class Driver:
    """Owns the store, admission, the planner and the reorganizers of one job; serves its ranks.

    Build with ``Driver.Config(...).build(admission=...)``; give each rank ``rank_spec()``.
    ``write`` takes completed trajectories (thread-safe; ``RolloutWriter(driver)`` works), admits
    mini-batches, plans each once for the backbone and encoder topologies, and a scheduler
    thread serves every pass of each in order (see NOTE [ Driver threads ]). A mini-batch's
    units are freed once every declared pass consumed it and its reorganizers published it.
    ``produced`` / ``consumed`` answer like TransferQueue's production and consumption status;
    ``progress``, ``metrics`` and the ``observe`` hook give the run's figures.

    Checkpoints: ``state_dict(trained=k)`` at a step boundary, ``load_state_dict`` and
    ``reissue()`` on a fresh driver to resume (see NOTE [ Resume rule ] in checkpoint_state.py).
    Its live position: ``ledger(...)`` / the core's ``JobLedger`` (every unreleased mini-batch:
    trajectories, registered plan, per pass served / groups done / outputs received / figures,
    produced fields; the serving order; the waiting trajectories; counters), the scheduler's
    cursor and the intake's field classification and open GRPO groups.
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        """The job's shape and the driver's knobs; runtime objects are ``build`` arguments."""

        passes: tuple[Pass, ...]
        """The step's passes, in order (see ``Pass``)."""
        topology: Topology
        """The backbone's DP x CP x TP."""
        encoders: tuple[EncoderTopology, ...] = ()
        """At most one multimodal encoder, with its own topology."""
        pipeline: int = 1
        """Pipeline stages: every stage's TP ranks read their (DP, CP) group's ring of that stage
        (its layers only of ``planner.stage_layers``' fields)."""
        planner: PlannerConfig = field(default_factory=PlannerConfig)
        """Budgets and balance; its ``token_fields`` / ``scalar_fields`` are replaced by the
        passes' reads."""
        max_minibatches: int | None = None
        """Stop admitting after this many mini-batches (later trajectories are stored and
        released at close); ``None``: admit as long as trajectories come."""
        slot_bytes: int = 64 << 20
        """Data rings: the largest packed micro-batch (or encoder micro-batch) must fit."""
        num_slots: int = PREFETCH_DEPTH + 2
        """Data rings: micro-batches a reorganizer may publish ahead of its ranks; at least the
        ranks' prefetch depth + 2 (NOTE [ Data ring slots ])."""
        schedule_slot_bytes: int = 4 << 20
        """Schedule ring: the largest mini-batch plan (JSON) must fit."""
        schedule_slots: int = 4
        """Schedule ring: passes the driver may publish ahead of the slowest rank."""
        write_back_slot_bytes: int = 8 << 20
        """Write-back rings: one micro-batch's outputs must fit."""
        write_back_slots: int = 4
        liveness_timeout_s: float = 30.0
        """A producer (reorganizer, writer rank, the driver) silent this long counts as dead."""
        wait_timeout_s: float = 600.0
        """Default bound of every blocking call (``drain``, a rank's wait for its next pass)."""
        pass_timeout_s: float = 1800.0
        """How long the scheduler waits for the fields a pass reads before it fails with
        ``WriteBackMissingError`` (a writer rank that stopped)."""
        attach_timeout_s: float = 600.0
        """How long after the first pass is served a group's writer rank may take to attach
        before the job fails naming the group (``RankFailedError``: no rank attached)."""
        join_timeout_s: float = 10.0
        """How long ``close`` waits for each thread and reorganizer."""
        restart_reorganizers: int = 0
        """Reorganizers that die (process killed, Ray actor gone) restarted over the whole job,
        their mini-batches re-served and their ranks moved on; 0: the job fails
        (``ReorganizerFailedError``). See NOTE [ Reorganizer restart ] in recovery.py."""

        def build(
            self,
            *,
            admission: AdmissionController,
            store: TrajectoryStore | None = None,
            pool: ReorganizerPool | None = None,
            observe: MetricsObserver | None = None,
            control: ControlPlane | None = None,
        ) -> Driver:
            """A running driver. ``store`` defaults to a fresh shared-memory store the driver
            closes; ``pool`` to one reorganizer process per consumer group (on this node);
            ``observe`` gets every released mini-batch's figures (step 1, 2, ...); ``control``
            to ``LocalControl()`` (ranks on this node; ``knitkit.integration.ray.RayControl``
            for ranks on other nodes: NOTE [ Control across nodes ] in control.py)."""
            return Driver(
                self, admission=admission, store=store, pool=pool, observe=observe, control=control
            )

    def __init__(
        self,
        config: Config,
        *,
        admission: AdmissionController,
        store: TrajectoryStore | None = None,
        pool: ReorganizerPool | None = None,
        observe: MetricsObserver | None = None,
        control: ControlPlane | None = None,
    ) -> None:
        self.config = config
        passes = check_passes(config.passes)
        _check_encoders(config, passes)
        self.admission = admission
        with contextlib.ExitStack() as undo:
            self._owns_store = store is None
            self.store = store if store is not None else TrajectoryStore(SharedMemoryBackend())
            if self._owns_store:
                undo.callback(self.store.close)
            for output in (o for p in passes for o in p.writes):
                self.store.declare_field(output.name, output.dtype, output.row_shape)
            groups = _groups(config)
            if pool is None:
                pool = ProcessPool(
                    self.store.backend,
                    groups,
                    num_slots=config.num_slots,
                    slot_bytes=config.slot_bytes,
                    join_timeout_s=config.join_timeout_s,
                    liveness_timeout_s=config.liveness_timeout_s,
                )
                undo.callback(pool.close)
            missing = sorted(set(groups) - set(pool.rings))
            if missing:
                raise ValueError(f"the reorganizer pool serves no rings for groups {missing}")
            if config.restart_reorganizers:  # see NOTE [ Reorganizer restart ]
                pool = RestartingPool(pool, config.restart_reorganizers)
            t = config.topology
            self._write_back = {
                group_name(d, c): RingSpec.new(
                    num_slots=config.write_back_slots,
                    slot_bytes=config.write_back_slot_bytes,
                    num_consumers=1,
                )
                for d in range(t.dp)
                for c in range(t.cp)
            }
            # driver <-> every rank (see NOTE [ Control across nodes ] in control.py)
            channels = (control or LocalControl()).open(
                ControlLayout(
                    world_size=t.dp * t.cp * t.tp * config.pipeline,
                    schedule_slots=config.schedule_slots,
                    schedule_slot_bytes=config.schedule_slot_bytes,
                    write_back=self._write_back,
                    liveness_timeout_s=config.liveness_timeout_s,
                    units=self.store.backend,
                    topology=t,
                    pipeline=config.pipeline,
                    passes=tuple(p.name for p in passes),
                )
            )
            undo.callback(channels.close)
            self._core = JobCore(
                passes,
                self.store,
                pool,
                channels,
                config.pipeline,
                liveness_timeout_s=config.liveness_timeout_s,
            )
            self._intake = Intake(
                self._core,
                admission,
                t,
                config.encoders,
                config.planner,
                config.max_minibatches,
            )
            self._scheduler = Scheduler(self._core, observe, pass_timeout_s=config.pass_timeout_s)
            self._collectors = [
                Collector(self._core, name, channels.write_back[name], config.attach_timeout_s)
                for name in self._write_back
            ]
            self._closed = False
            for thread in (self._scheduler.thread, *(c.thread for c in self._collectors)):
                thread.start()
            undo.pop_all()

    @property
    def passes(self) -> tuple[Pass, ...]:
        return self._core.passes

    @property
    def pool(self) -> ReorganizerPool:
        """The reorganizers (for monitoring, and for recovery: ``pool.replace(group)``)."""
        return self._core.pool

    # ----- writing ------------------------------------------------------------------------------
    def write(self, trajectory: Trajectory) -> TrajectoryMeta:
        """Store a completed trajectory, report it to admission, and admit (plan, register) every
        mini-batch that becomes admissible; returns its metadata. Thread-safe.

        The trajectory must carry every field a pass reads that no pass writes (``ValueError``
        naming trajectory and field, nothing stored). Same signature as ``TrajectoryStore.write``,
        so a rollout writer that takes a store (``RolloutWriter(driver)``) feeds the driver.
        """
        core = self._core
        with core.lock:
            self._check_open()
            meta = self._intake.write(trajectory)
            core.lock.notify_all()
            return meta

    def adopt(self, placed: PlacedTrajectory) -> TrajectoryMeta:
        """``write`` for a trajectory whose units its rollout writer put in the store's backend
        on its own node (``knitkit.storage.UnitPlacer``): the driver takes only the
        record (``PlacedTrajectory.from_dict`` of what the writer sent), checks the units in
        one lookup and never holds their payload (NOTE [ Units stay where they are produced ]).
        """
        core = self._core
        with core.lock:
            self._check_open()
            meta = self._intake.adopt(placed)
            core.lock.notify_all()
            return meta

    def issued(self, rollout_step: int, count: int) -> None:
        """Tell admission ``count`` more trajectories were issued in ``rollout_step``."""
        with self._core.lock:
            self.admission.issued(rollout_step, count)

    def shortfall(self, in_flight: Mapping[str, int] | None = None) -> Shortfall:
        """What the open train batch still lacks (``AdmissionController.shortfall``)."""
        with self._core.lock:
            return self.admission.shortfall(in_flight)

    def finish(self) -> None:
        """No more mini-batches: once every admitted one is served, ranks' ``passes()`` end."""
        with self._core.lock:
            self._scheduler.finishing = True
            self._core.lock.notify_all()

    # ----- checkpoint and resume (see NOTE [ Resume rule ] in checkpoint_state.py) -------------
    def state_dict(self, *, trained: int, timeout_s: float | None = None) -> dict[str, Any]:
        """The driver's checkpoint as plain JSON-able data, taken at a step boundary: the model
        state saved beside it has trained the first ``trained`` mini-batches (serving order).

        Holds admission's state, the serving order, the pending (admitted, untrained)
        mini-batches with their trajectories, the waiting trajectories, the field
        classification, the open GRPO groups and the counters; not the store's units (the
        resumed driver names the trajectories to re-write), but on a durable backend the
        store's index of those trajectories, whose units stay there. Waits until the first
        ``trained`` are released (``TimeoutError`` after ``timeout_s``, default
        ``Config.wait_timeout_s``); ``ValueError`` if a later one is (the model state would not
        hold it).
        """
        core = self._core

        def taken() -> Snapshot | None:
            ledger = core.ledger
            if trained > len(ledger.order):
                raise ValueError(
                    f"state_dict(trained={trained}): only {len(ledger.order)} mini-batches "
                    "were admitted"
                )
            done = self._released_positions()
            late = [ledger.order[i] for i in done if i >= trained]
            if late:
                raise ValueError(
                    f"state_dict(trained={trained}): mini-batches {late} are released too; "
                    "take the checkpoint at the step boundary of the model state saved "
                    "with it (see NOTE [ Resume rule ])"
                )
            if len(done) == trained:
                return self._snapshot(trained)
            return None

        def outstanding(timeout: float) -> str:
            done = set(self._released_positions())
            waiting = [m for i, m in enumerate(core.ledger.order[:trained]) if i not in done]
            return (
                f"state_dict(trained={trained}): mini-batches {waiting} not released after "
                f"{timeout} s: {self._outstanding()}"
            )

        # NOTE [ Checkpoint without holding writers ]:
        # Every write waits for the core lock (NOTE [ Driver threads ]), so the checkpoint holds
        # it only to COPY what it saves, at one instant: admission's snapshot (references to
        # what is pending and the duplicate window, no encoding: NOTE [ Admission state ]), the
        # ledger's order, pending mini-batches, waiting trajectories and counters, and on a
        # durable backend the store's index of the trajectories it needs (copied records; the
        # backend flushed, their units taken off later deletes: NOTE [ Units outlive their last
        # state ]). Encoding all of it and syncing the shards (NOTE [ Durable shards ]) happen
        # after the lock is released, while writes, admissions and serving go on: the copies do
        # not change under them, later flushes are synced by the next checkpoint, and the units
        # the copy names cannot be deleted meanwhile.
        snapshot = self._wait_until(taken, timeout_s, outstanding)
        return snapshot.encode()

    def load_state_dict(self, state: Mapping[str, Any]) -> Resumed:
        """Resume from ``state_dict()``'s output, on a fresh driver (nothing written yet).

        Restores admission and the position (and, over a durable backend holding them, the
        checkpoint's trajectories: ``Resumed.restored``); the pending mini-batches are
        re-planned for this driver's topology and re-served from their first pass once every
        trajectory ``reissue()`` names is re-written (other writes are refused until then).
        Different passes are refused naming them; a different layout (DP, CP, TP, pipeline,
        encoder, reorganizers) is re-planned and named in the result. See NOTE [ Resume rule ].
        """
        saved = checkpoint_state.decode(dict(state))
        replanned = checkpoint_state.check_shape(saved.shape, self._shape())
        core = self._core
        with core.lock:
            self._check_open()
            ledger = core.ledger
            if ledger.order or ledger.waiting or self._intake.resumed is not None:
                raise ValueError("load_state_dict needs a fresh driver (nothing written yet)")
            self.admission.load_state_dict(saved.admission)
            restored: tuple[str, ...] = ()
            if saved.store is not None and self.store.backend.durable:
                self.store.load_state_dict(saved.store, strict=False)  # the rest: re-written
                restored = tuple(t for t in saved.reissue() if t in self.store.index)
            ledger.order[:] = saved.order
            ledger.released = ledger.observed = saved.released
            ledger.counts.update(saved.counts)
            ledger.wait_s = saved.wait_s
            self._scheduler.position = saved.released
            self._intake.resume(saved, restored)
            core.lock.notify_all()
            return Resumed(
                saved.released,
                tuple(p.minibatch_id for p in saved.pending),
                tuple(self._intake.reissue),
                replanned,
                restored,
            )

    def reissue(self) -> tuple[str, ...]:
        """Trajectories a resumed driver still needs re-written (empty once resumed)."""
        with self._core.lock:
            return tuple(self._intake.reissue)

    def _snapshot(self, trained: int) -> Snapshot:
        """The checkpoint's copy, under the lock (NOTE [ Checkpoint without holding writers ])."""
        core, intake = self._core, self._intake
        ledger = core.ledger
        resumed = intake.resumed
        saved = {p.minibatch_id: p for p in resumed.pending} if resumed is not None else {}
        pending = []
        for mb in ledger.order[trained:]:
            if mb in saved:
                pending.append(saved[mb])
                continue
            live = ledger.minibatches[mb]
            pending.append(
                Pending(mb, live.train_batch, live.index, live.admitted, dict(live.sources))
            )
        waiting = sorted(ledger.waiting | set(resumed.waiting if resumed else ()))
        groups = [(s, g, [t for t, _ in ids]) for (s, g), ids in intake.groups_open.items()]
        if resumed is not None:
            groups += resumed.groups_open
        state = DriverState(
            shape=self._shape(),
            admission={},
            order=list(ledger.order),
            released=trained,
            pending=pending,
            waiting=waiting,
            token_fields=None if intake.token_fields is None else list(intake.token_fields),
            scalar_fields=list(intake.scalar_fields),
            groups_open=groups,
            counts=dict(ledger.counts),
            wait_s=ledger.wait_s,
        )
        store = None
        if self.store.backend.durable:
            stored = [t for t in state.reissue() if t in self.store.index]  # resumed: not all back
            store = self.store.snapshot(trajectories=stored, fields=core.rollout)
        return Snapshot(state, self.admission.snapshot(), store)

    def _shape(self) -> Shape:
        c = self.config
        return Shape.of(
            self.passes, c.topology, c.pipeline, c.encoders, list(self._core.pool.rings)
        )

    # ----- what ranks need, and what the job did -------------------------------------------------
    def rank_spec(self, **extra: object) -> RankSpec:
        """What every rank needs (``RankHandle(spec, coords)``); ``extra`` travels with it."""
        c = self.config
        rings = self._core.control.rings
        return RankSpec(
            topology=c.topology,
            pipeline=c.pipeline,
            passes=self.passes,
            encoders=c.encoders,
            rings=dict(self._core.pool.rings),
            schedule=rings.schedule,
            nodes=rings.nodes,
            schedules=dict(rings.schedules),
            write_back=dict(self._write_back),
            liveness_timeout_s=c.liveness_timeout_s,
            wait_timeout_s=c.wait_timeout_s,
            extra={RESTARTS_KEY: c.restart_reorganizers, **extra}
            if c.restart_reorganizers
            else dict(extra),
        )

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every admitted mini-batch is consumed by every pass, released and observed.

        Their units are freed by the scheduler right after, once their reorganizers published
        them (a re-served assignment nobody reads any more, after a restart at the job's end,
        keeps its units until ``close``: see NOTE [ Reorganizer restart ] in recovery.py).

        Raises the driver's failure, or ``TimeoutError`` after ``timeout_s`` (default
        ``Config.wait_timeout_s``) naming what is still outstanding.
        """
        core = self._core

        def drained() -> bool | None:
            ledger = core.ledger
            done = ledger.released == len(ledger.order) and ledger.observed == ledger.released
            return True if done else None

        def outstanding(timeout: float) -> str:
            left = len(core.ledger.order) - core.ledger.released
            return (
                f"drain: {left} mini-batches not consumed after {timeout} s: {self._outstanding()}"
            )

        self._wait_until(drained, timeout_s, outstanding)

    def produced(self, minibatch_id: str, field: str) -> bool:
        """Whether ``field`` is in the store for every trajectory of the admitted mini-batch
        (rollout fields: from admission on; written fields: once every output arrived)."""
        core = self._core
        with core.lock:
            core.ledger.position(minibatch_id)
            if field not in core.rollout and field not in core.writer_of:
                raise KeyError(f"no pass reads or writes field {field!r}")
            ledger = core.ledger.minibatches.get(minibatch_id)
            if ledger is None:
                return self._released(minibatch_id) or field in core.rollout
            return field in core.rollout or field in ledger.produced

    def consumed(self, minibatch_id: str, pass_name: str) -> bool:
        """Whether every (DP, CP) group finished ``pass_name`` of the mini-batch."""
        core = self._core
        with core.lock:
            self._pass(pass_name)
            core.ledger.position(minibatch_id)
            ledger = core.ledger.minibatches.get(minibatch_id)
            if ledger is None:
                return self._released(minibatch_id)
            return ledger.consumed(pass_name)

    def consumers(self, minibatch_id: str, pass_name: str) -> tuple[str, ...]:
        """The (DP, CP) groups that finished ``pass_name`` of an unreleased mini-batch."""
        with self._core.lock:
            self._pass(pass_name)
            return tuple(sorted(self.ledger(minibatch_id).passes[pass_name].done))

    def minibatches(self) -> tuple[str, ...]:
        """Every admitted mini-batch's id (``tb<train batch>-mb<index>``), in serving order."""
        with self._core.lock:
            return tuple(self._core.ledger.order)

    def ledger(self, minibatch_id: str) -> MiniBatchLedger:
        """The live ledger of an unreleased mini-batch (it changes as the job goes on)."""
        core = self._core
        with core.lock:
            core.ledger.position(minibatch_id)
            try:
                return core.ledger.minibatches[minibatch_id]
            except KeyError:
                raise KeyError(
                    f"mini-batch {minibatch_id!r} is released (every pass consumed it)"
                ) from None

    def progress(self) -> Progress:
        core = self._core
        with core.lock:
            ledger = core.ledger
            live = ledger.minibatches.values()
            served = {
                p.name: ledger.released + sum(g.served(p.name) for g in live) for p in self.passes
            }
            consumed = {
                p.name: ledger.released + sum(g.consumed(p.name) for g in live) for p in self.passes
            }
            return Progress(
                len(ledger.order),
                ledger.released,
                served,
                consumed,
                len(ledger.waiting),
                self._scheduler.blocked,
            )

    def metrics(self) -> dict[str, float]:
        """The run's figures: admission's, the store's, the reorganizers' and the driver's own
        (``knitkit/job/...``; counters cumulative):

        - ``minibatches_admitted``, ``minibatches_released``: mini-batches so far;
        - ``passes_served``, ``passes_consumed``: (mini-batch, pass) pairs so far;
        - ``write_back_records``, ``write_back_bytes``: outputs received from writer ranks;
        - ``write_back_wakes``: collector wakes that applied records (one lock hold each, all the
          records already published: NOTE [ A pass's records in one wake ] in collect.py);
        - ``pass_wait_s``: seconds the scheduler waited for passes' reads to be produced;
        - ``trajectories_waiting``: stored trajectories in no admitted mini-batch (now).
        """
        core = self._core
        with core.lock:
            return merge(self.admission.metrics(), core.parts_metrics(), core.job_metrics())

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the driver, if any."""
        return self._core.failure

    def close(self) -> None:
        """Stop the threads, the reorganizers and the rings; free every unreleased trajectory;
        close the store if the driver made it. Idempotent; each step bounded by
        ``join_timeout_s``."""
        core = self._core
        with core.lock:
            if self._closed:
                return
            self._closed = True
            core.stopping.set()
            core.lock.notify_all()
        core.schedule.stop()
        join = self.config.join_timeout_s
        self._scheduler.thread.join(join)
        for collector in self._collectors:
            collector.close()
        for collector in self._collectors:
            collector.thread.join(join)
        lost = core.failure
        if isinstance(lost, NodeFailedError) and isinstance(core.pool, NodeAware):
            core.pool.node_lost(lost.node)  # its actors there are not waited for
        core.pool.close()
        if not self._scheduler.finished:
            reason = f": {core.failure}" if core.failure else ""
            core.schedule.fail(f"the driver closed before serving everything{reason}")
        core.control.close()
        with core.lock:
            for minibatch_id, consumer in core.unfreed:  # no reorganizer reads any more
                self.store.consumed(minibatch_id, consumer)
            core.unfreed.clear()
            for minibatch_id in list(core.ledger.minibatches):
                self.store.abort(minibatch_id)
            self.store.release(sorted(core.ledger.waiting))
            resumed = self._intake.resumed
            if resumed is not None:  # re-written, not registered yet
                back = [t for t in resumed.reissue() if t not in self._intake.reissue]
                self.store.release(back)
            core.ledger.minibatches.clear()
            core.ledger.waiting.clear()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the driver is closed; build a new one")
        self._core.raise_failure()

    def _released(self, minibatch_id: str) -> bool:
        """Whether an admitted mini-batch with no live ledger is released (not pending re-write)."""
        resumed = self._intake.resumed
        return resumed is None or all(p.minibatch_id != minibatch_id for p in resumed.pending)

    def _pass(self, name: str) -> Pass:
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(f"no pass {name!r}; passes: {[p.name for p in self.passes]}")

    def _wait_until(
        self,
        ready: Callable[[], _T | None],
        timeout_s: float | None,
        late: Callable[[float], str],
    ) -> _T:
        """Under the lock, woken by the driver's threads: ``ready()``'s first value that is not
        ``None``; the driver's failure as soon as it is recorded; ``TimeoutError(late(timeout))``
        after ``timeout_s`` (default ``Config.wait_timeout_s``)."""
        timeout = self.config.wait_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        core = self._core
        with core.lock:
            while True:
                core.raise_failure()
                value = ready()
                if value is not None:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(late(timeout))
                core.lock.wait(min(left, IDLE_S))

    def _released_positions(self) -> list[int]:
        """Positions in the serving order of the released mini-batches (under the lock)."""
        core = self._core
        unreleased = set(core.ledger.minibatches)
        resumed = self._intake.resumed
        if resumed is not None:
            unreleased |= {p.minibatch_id for p in resumed.pending}
        return [i for i, mb in enumerate(core.ledger.order) if mb not in unreleased]

    def _outstanding(self) -> str:
        parts = []
        for ledger in list(self._core.ledger.minibatches.values())[:3]:
            for p in self.passes:
                state = ledger.passes[p.name]
                left = sorted(set(ledger.groups) - state.done)
                if left:
                    served = "served" if state.served_to_any else "not served yet"
                    parts.append(f"{ledger.minibatch_id}/{p.name} ({served}) waits for {left}")
                    break
        blocked = self._scheduler.blocked
        return "; ".join(parts + ([blocked] if blocked else [])) or "observer calls pending"


def _check_encoders(config: Driver.Config, passes: tuple[Pass, ...]) -> None:
    if len(config.encoders) > 1:
        raise ValueError(
            f"Driver.Config.encoders has {len(config.encoders)} encoders; a job serves one "
            "encoder ring per rank, give at most one"
        )
    if any(p.encodes for p in passes) and not config.encoders:
        raise ValueError(
            "a pass has encodes=True but Driver.Config.encoders is empty; give the encoder's "
            "EncoderTopology, or set encodes=False"
        )


def _groups(config: Driver.Config) -> dict[str, int]:
    """Every data ring of the job with its number of consumers: a ring per (DP, CP, stage),
    read by the stage's TP ranks (NOTE [ One ring per pipeline stage ] in
    knitkit/storage/planning/plan.py), and per encoder rank."""
    t = config.topology
    layers = config.planner.stage_layers
    if layers is not None and layers.stages != config.pipeline:
        raise ValueError(
            f"PlannerConfig.stage_layers splits layers over {layers.stages} stages; the job has "
            f"pipeline={config.pipeline}: give one layer range per stage"
        )
    groups = {
        ring: t.tp
        for d in range(t.dp)
        for c in range(t.cp)
        for ring in data_rings(group_name(d, c), config.pipeline)
    }
    for encoder in config.encoders:
        groups.update({encoder_rank_name(encoder.name, r): encoder.tp for r in range(encoder.dp)})
    return groups
