"""The admission controller: report completed trajectories, take admitted mini-batches (paper 5.1)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType

from knitkit.admission.config import AdmissionConfig, resolve
from knitkit.admission.guards import candidate_admissible, guard_coverable
from knitkit.admission.pool import ReadyPool, Unit
from knitkit.admission.predicates import AdmissionView
from knitkit.admission.selection import CandidateRequest
from knitkit.types import TrajectoryMeta


@dataclass(frozen=True, slots=True)
class MiniBatch:
    """One admitted mini-batch: irrevocably part of train batch ``train_batch``."""

    train_batch: int
    index: int
    """0-based position within the train batch; ``index == num_minibatches - 1`` closes it."""
    trajectories: tuple[TrajectoryMeta, ...]


@dataclass(slots=True)
class AdmissionStats:
    """Counters: every reported trajectory ends up in exactly one of them (or is still pending)."""

    reported: int = 0
    admitted: int = 0
    rejected: int = 0
    """Reported with ``accepted=False`` (or in a GRPO group with one): counted, never trained on."""
    stale_dropped: int = 0
    """Filtered by ``max_staleness``."""
    discarded: int = 0
    """Dropped on purpose by ``discard_pending`` (e.g. synchronous RL without partial rollout)."""


class AdmissionController:
    """Admits mini-batches from reported trajectories so each train batch meets its quotas.

    ``next_minibatch`` admits the t-th mini-batch iff every readiness target tau_{i,t} holds
    (eq. 3), the selection policy proposes a candidate, and every group's feasibility guard
    holds on it (eq. 4); admission is irrevocable (eq. 5). Reports and readiness checks cost
    O(#sources): the ready pool keeps per-source queues and counters.

    The controller holds no lock: Call ``report``, ``issued`` and
    ``next_minibatch`` from one thread (the trainer's rollout loop, or one actor that owns it);
    a failed call raises before changing state, so the caller may log and continue.
    """

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._quotas, self.minibatch_sizes = resolve(config)
        # With atomic GRPO groups a lower bound is only met in whole groups, so the guards
        # count deficits rounded up to the group size (else a guard could pass on 1 + 1 <= 4
        # free slots when two whole groups, 8 slots, are needed).
        g = config.group_size
        self._guard_lower = {q.source: -(-q.lower // g) * g for q in self._quotas}
        self._group_lowers = tuple(
            tuple((q.source, self._guard_lower[q.source]) for q in self._quotas if q.group == name)
            for name in dict.fromkeys(q.group for q in self._quotas)
        )
        self._groups = tuple(tuple(s for s, _ in group) for group in self._group_lowers)
        self._size_targets = [
            math.ceil(a * config.train_batch_size - 1e-9)
            for a in config.size_schedule.alphas(config.num_minibatches)
        ]
        self._pool = ReadyPool(config.sources)
        self._seen: set[str] = set()
        self._open_groups: dict[str, list[TrajectoryMeta]] = {}
        self._completed_by_step: Counter[int] = Counter()
        self._issued_by_step: Counter[int] = Counter()
        self._seq = 0
        self.stats = AdmissionStats()
        self.train_batch = 0
        self._t = 0
        self._admitted: dict[str, int] = dict.fromkeys(config.sources, 0)
        self._admitted_total = 0
        self._quota_targets: list[list[tuple[str, int]]] = []
        self._predicate_alphas = [
            p.schedule.alphas(config.num_minibatches) for p in config.predicates
        ]
        self._open_view: AdmissionView
        """Counts when the open train batch opened (issues live); set when predicates exist."""
        self._open_train_batch()

    @property
    def training_version(self) -> int:
        """Version the open train batch trains at (staleness reference)."""
        return self.config.initial_version + self.train_batch

    @property
    def pending(self) -> int:
        """Accepted trajectories reported but not yet admitted (ready, or in an incomplete group)."""
        return len(self._pool) + sum(len(g) for g in self._open_groups.values())

    def ready_counts(self) -> dict[str, int]:
        return dict(self._pool.ready)

    def issued(self, rollout_step: int, count: int) -> None:
        """Tell the controller ``count`` more trajectories were issued in ``rollout_step``."""
        if rollout_step < 0 or count < 0:
            raise ValueError(
                f"issued(rollout_step={rollout_step}, count={count}): both must be >= 0"
            )
        self._issued_by_step[rollout_step] += count

    def report(self, meta: TrajectoryMeta) -> None:
        """Record one completed trajectory; validates before changing any state."""
        if meta.source not in self._pool.ready:
            raise ValueError(
                f"trajectory {meta.trajectory_id!r}: unknown source {meta.source!r}; "
                f"configured sources: {self.config.sources}"
            )
        if meta.trajectory_id in self._seen:
            raise ValueError(f"trajectory {meta.trajectory_id!r} was already reported")
        if meta.num_tokens < 0 or meta.rollout_step < 0:
            raise ValueError(
                f"trajectory {meta.trajectory_id!r}: num_tokens={meta.num_tokens}, "
                f"rollout_step={meta.rollout_step}; both must be >= 0"
            )
        self._seen.add(meta.trajectory_id)
        self._completed_by_step[meta.rollout_step] += 1
        self.stats.reported += 1
        if self.config.group_size == 1:
            self._add((meta,))
            return
        group = self._open_groups.setdefault(meta.sample_id, [])
        group.append(meta)
        if len(group) == self.config.group_size:
            del self._open_groups[meta.sample_id]
            self._add(tuple(group))

    def discard_pending(self) -> int:
        """Drop every pending trajectory (counted in ``stats.discarded``); returns how many."""
        dropped = self._pool.clear()
        count = sum(u.size for u in dropped) + sum(len(g) for g in self._open_groups.values())
        self._open_groups.clear()
        self.stats.discarded += count
        if self._t == 0:
            self._open_train_batch()  # s_{i,0} counted the discarded trajectories
        return count

    def _add(self, trajectories: tuple[TrajectoryMeta, ...]) -> None:
        if not (
            trajectories[0].accepted
            if len(trajectories) == 1
            else all(t.accepted for t in trajectories)
        ):
            self.stats.rejected += len(trajectories)
            return
        unit = Unit(self._seq, trajectories[0].source, trajectories)
        self._seq += 1
        if self._is_stale(unit):
            self.stats.stale_dropped += unit.size
            return
        self._pool.push(unit)

    def _is_stale(self, unit: Unit) -> bool:
        bound = self.config.max_staleness
        return bound is not None and self.training_version - unit.min_version > bound

    def next_minibatch(self) -> MiniBatch | None:
        """Admit and return the next mini-batch if eq. (5) holds now, else None (nothing changes)."""
        t = self._t
        size = self.minibatch_sizes[t]
        if len(self._pool) < size or not self._ready(t):
            return None
        guarded = self.config.enforce_quotas and self.config.guards
        slots_after = self.config.train_batch_size - self._admitted_total - size
        if guarded and not guard_coverable(
            self._group_lowers, self._admitted, self._pool.ready, slots_after
        ):
            return None
        request = self._request(size, guarded)
        counts = self.config.selection.propose(request, self._pool)
        if counts is None or not candidate_admissible(counts, request, self._pool):
            return None
        units = self._pool.take(counts)
        trajectories = tuple(tr for u in units for tr in u.trajectories)
        for unit in units:
            self._admitted[unit.source] += unit.size
        self._admitted_total += len(trajectories)
        self.stats.admitted += len(trajectories)
        batch = MiniBatch(self.train_batch, t, trajectories)
        self._t += 1
        if self._t == self.config.num_minibatches:
            self.train_batch += 1
            self._t = 0
            self._admitted = dict.fromkeys(self.config.sources, 0)
            self._admitted_total = 0
            if self.config.max_staleness is not None:
                oldest = self.training_version - self.config.max_staleness
                self.stats.stale_dropped += sum(
                    u.size for u in self._pool.expire_older_than(oldest)
                )
            self._open_train_batch()
        return batch

    def _open_train_batch(self) -> None:
        """Snapshot s_{i,0} for every quota and predicate when a train batch opens."""
        n = self.config.num_minibatches
        self._quota_targets = [
            [
                (q.source, math.ceil(start + q.alphas[t] * (q.lower - start) - 1e-9))
                for q in self._quotas
                for start in (float(self._pool.ready[q.source]),)
            ]
            for t in range(n)
        ]
        if self.config.predicates:
            self._open_view = AdmissionView(
                self.train_batch,
                1,
                dict(self._pool.ready),
                dict(self._admitted),
                dict(self._completed_by_step),
                MappingProxyType(self._issued_by_step),
            )

    def _view(self, t: int) -> AdmissionView:
        return AdmissionView(
            self.train_batch,
            t + 1,
            MappingProxyType(self._pool.ready),
            MappingProxyType(self._admitted),
            MappingProxyType(self._completed_by_step),
            MappingProxyType(self._issued_by_step),
        )

    def _ready(self, t: int) -> bool:
        """The readiness predicates P_{i,t} (eq. 3) for the size target, quotas and user predicates."""
        if self._admitted_total + len(self._pool) < self._size_targets[t]:
            return False
        if self.config.enforce_quotas:
            admitted, ready = self._admitted, self._pool.ready
            for source, target in self._quota_targets[t]:
                if admitted[source] + ready[source] < target:
                    return False
        if self.config.predicates:
            view = self._view(t)
            for predicate, alphas in zip(
                self.config.predicates, self._predicate_alphas, strict=True
            ):
                # s_{i,0} is the progress at train-batch open measured
                # against what the predicate measures now (counts at open, issues now): a
                # completion quota's step issued mid-batch starts from its own progress at open
                # (0), not the previous step's. A start past the target is the target.
                goal = predicate.target(view)
                start = min(predicate.progress(self._open_view), goal)
                if predicate.progress(view) < start + alphas[t] * (goal - start) - 1e-9:
                    return False
        return True

    def _request(self, size: int, guarded: bool) -> CandidateRequest:
        enforce = self.config.enforce_quotas
        return CandidateRequest(
            size=size,
            slots_after=self.config.train_batch_size - self._admitted_total - size,
            deficits={s: max(0, lo - self._admitted[s]) for s, lo in self._guard_lower.items()},
            room={
                q.source: q.upper - self._admitted[q.source]
                for q in self._quotas
                if enforce and q.upper is not None
            },
            groups=self._groups,
            guarded=guarded,
        )
