"""Trajectories in: store, report to admission, and plan every admitted mini-batch once."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection, Sequence

from knitkit.admission import AdmissionController
from knitkit.job.checkpoint_state import DriverState, Pending
from knitkit.job.core import JobCore
from knitkit.job.ledger import new_ledger
from knitkit.storage import (
    EncoderTopology,
    PlacedTrajectory,
    PlannerConfig,
    Topology,
    Trajectory,
    plan_minibatch,
)
from knitkit.types import TrajectoryMeta


class Intake:
    """The driver's writing side (called under the core's lock): checks a trajectory against
    the passes' reads, stores it, reports it, frees what admission will never admit, and plans
    and registers each admitted mini-batch into the ledger, in admission order.

    Holds the field classification (per-token or scalar, learnt from the first trajectory),
    the incomplete GRPO groups it mirrors from admission, and after a resume the trajectories
    still to re-write (see NOTE [ Resume rule ] in checkpoint_state.py); the waiting
    trajectories are in the ledger.
    """

    def __init__(
        self,
        core: JobCore,
        admission: AdmissionController,
        topology: Topology,
        encoders: Sequence[EncoderTopology],
        planner: PlannerConfig,
        max_minibatches: int | None,
    ) -> None:
        self.core = core
        self.admission = admission
        self.topology, self.encoders, self.planner = topology, tuple(encoders), planner
        self.max_minibatches = max_minibatches
        self.token_fields: tuple[str, ...] | None = None
        """Rollout fields stored per token (``None`` until the first trajectory)."""
        self.scalar_fields: tuple[str, ...] = ()
        self.groups_open: dict[tuple[str, str], list[tuple[str, bool]]] = {}
        """Incomplete GRPO groups by (source, sample id): (trajectory id, accepted) so far."""
        self.reissue: dict[str, None] = {}
        """After a resume: trajectories the checkpoint needs that are not re-written yet."""
        self.resumed: DriverState | None = None
        """After a resume, until every trajectory of ``reissue`` is back."""

    def write(self, trajectory: Trajectory) -> TrajectoryMeta:
        return self._take(
            trajectory.trajectory_id,
            trajectory.token_fields,
            trajectory.scalars,
            lambda: self.core.store.write(trajectory),
        )

    def adopt(self, placed: PlacedTrajectory) -> TrajectoryMeta:
        """``write`` for a trajectory whose units its writer placed (NOTE [ Units stay where
        they are produced ])."""
        record = placed.record
        return self._take(
            record.meta.trajectory_id,
            record.token_fields,
            set(record.fields) - record.token_fields,
            lambda: self.core.store.adopt(placed),
        )

    def _take(
        self,
        tid: str,
        token_fields: Collection[str],
        scalars: Collection[str],
        store_it: Callable[[], TrajectoryMeta],
    ) -> TrajectoryMeta:
        """Classify, store (``store_it``), report and admit one trajectory."""
        if self.resumed is not None:
            return self._rewrite(tid, token_fields, scalars, store_it)
        self._classify(tid, token_fields, scalars)
        store, ledger = self.core.store, self.core.ledger
        meta = store_it()
        try:
            self.admission.report(meta)
        except BaseException:
            store.release([meta.trajectory_id])
            raise
        ledger.waiting.add(meta.trajectory_id)
        self._drop_rejected(meta)
        try:
            self._admit()
        except BaseException as error:  # admission is irrevocable: the job cannot go on
            self.core.fail(error)
            raise
        return meta

    def _classify(self, tid: str, token_fields: Collection[str], scalars: Collection[str]) -> None:
        """Check the trajectory brings every rollout field, each per-token or scalar as before."""
        rollout = self.core.rollout
        token = tuple(f for f in rollout if f in token_fields)
        scalar = tuple(f for f in rollout if f in scalars)
        missing = [f for f in rollout if f not in token and f not in scalar]
        if missing:
            readers = {f: [p.name for p in self.core.passes if f in p.reads] for f in missing}
            raise ValueError(
                f"trajectory {tid!r} has no field(s) {missing}, which "
                f"passes read ({readers}) and no pass writes; write them with every trajectory"
            )
        if self.token_fields is None:
            self.token_fields, self.scalar_fields = token, scalar
        elif (token, scalar) != (self.token_fields, self.scalar_fields):
            raise ValueError(
                f"trajectory {tid!r} carries per-token {list(token)} and "
                f"scalar {list(scalar)}, but earlier trajectories carry per-token "
                f"{list(self.token_fields)} and scalar {list(self.scalar_fields)}"
            )

    def _drop_rejected(self, meta: TrajectoryMeta) -> None:
        """Free trajectories admission will never admit: rejected, with their GRPO group."""
        size = self.admission.config.group_size
        if size == 1:
            group = [(meta.trajectory_id, meta.accepted)]
        else:
            group = self.groups_open.setdefault((meta.source, meta.sample_id), [])
            group.append((meta.trajectory_id, meta.accepted))
            if len(group) < size:
                return
            del self.groups_open[(meta.source, meta.sample_id)]
        if not all(accepted for _, accepted in group):
            ids = [tid for tid, _ in group]
            self.core.store.release(ids)
            self.core.ledger.waiting.difference_update(ids)

    def _admit(self) -> None:
        """Plan and register every mini-batch admission admits now (irrevocably: at once)."""
        ledger = self.core.ledger
        while self.max_minibatches is None or len(ledger.order) < self.max_minibatches:
            admitted = self.admission.next_minibatch()
            if admitted is None:
                return
            minibatch_id = f"tb{admitted.train_batch}-mb{admitted.index}"
            ids = tuple(m.trajectory_id for m in admitted.trajectories)
            sources = dict(Counter(m.source for m in admitted.trajectories))
            pending = Pending(minibatch_id, admitted.train_batch, admitted.index, ids, sources)
            self._register(pending, admitted.trajectories)
            ledger.order.append(minibatch_id)
            ledger.waiting.difference_update(ids)

    def _register(self, pending: Pending, metas: Sequence[TrajectoryMeta]) -> None:
        """Plan an admitted mini-batch once, register the plan, and open its ledger."""
        plan = plan_minibatch(
            metas, self.topology, self._planner(), self.encoders, pending.minibatch_id
        )
        plan = self.core.store.register(plan)
        self.core.ledger.minibatches[pending.minibatch_id] = new_ledger(
            pending.minibatch_id,
            pending.train_batch,
            pending.index,
            pending.sources,
            plan,
            self.core.passes,
            self.admission.metrics(),
            pending.trajectories,
        )

    def resume(self, state: DriverState, restored: Collection[str] = ()) -> None:
        """Take a checkpoint's position (on a fresh driver): its trajectories are to re-write,
        but for those ``restored`` (the store holds them again, from a durable backend)."""
        if state.token_fields is not None:
            self.token_fields = tuple(state.token_fields)
            self.scalar_fields = tuple(state.scalar_fields)
        self.reissue = dict.fromkeys(t for t in state.reissue() if t not in restored)
        self.resumed = state
        if not self.reissue:
            self._resume_done()

    def _rewrite(
        self,
        tid: str,
        token_fields: Collection[str],
        scalars: Collection[str],
        store_it: Callable[[], TrajectoryMeta],
    ) -> TrajectoryMeta:
        """Store a trajectory the checkpoint names, without reporting it to admission again
        (its restored state holds it); once all are back, register the pending mini-batches."""
        if tid not in self.reissue:
            missing = list(self.reissue)
            raise ValueError(
                f"trajectory {tid!r}: the driver resumed from a checkpoint and waits for the "
                f"{len(missing)} trajectories Driver.reissue() names (e.g. {missing[:3]}); "
                "re-write those first (see NOTE [ Resume rule ])"
            )
        self._classify(tid, token_fields, scalars)
        meta = store_it()
        del self.reissue[tid]
        if not self.reissue:
            try:
                self._resume_done()
            except BaseException as error:
                self.core.fail(error)
                raise
        return meta

    def _resume_done(self) -> None:
        state, store, ledger = self.resumed, self.core.store, self.core.ledger
        assert state is not None
        self.resumed = None
        for pending in state.pending:
            self._register(pending, [store.meta(t) for t in pending.trajectories])
        ledger.waiting.update(state.waiting)
        for source, sample, ids in state.groups_open:
            self.groups_open[(source, sample)] = [(t, store.meta(t).accepted) for t in ids]
        self._admit()

    def _planner(self) -> PlannerConfig:
        """The planner config with every field some pass reads, per-token or scalar."""
        reads = {f for p in self.core.passes for f in p.reads}
        written = [o.name for p in self.core.passes for o in p.writes]
        token = [f for f in (*(self.token_fields or ()), *written) if f in reads]
        scalar = [f for f in self.scalar_fields if f in reads]
        return dataclasses.replace(
            self.planner, token_fields=tuple(token), scalar_fields=tuple(scalar)
        )
