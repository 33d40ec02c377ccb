"""The admission controller: report completed trajectories, take admitted mini-batches (paper 5.1)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from knitkit.admission import checks, state
from knitkit.admission.config import AdmissionConfig, resolve
from knitkit.admission.guards import candidate_admissible, guard_coverable
from knitkit.admission.pool import ReadyPool, Unit
from knitkit.admission.predicates import AdmissionView
from knitkit.admission.recent import RecentWindow
from knitkit.admission.restore import Shape, read_state
from knitkit.admission.selection import CandidateRequest
from knitkit.collector import collector_paused
from knitkit.types import TrajectoryMeta

_WHOLE_FIELDS = (
    ("rollout_step", 0),
    ("num_tokens", 0),
    ("min_version", None),
    ("max_version", None),
)
"""Fields of a report that must be whole numbers, with their minimum."""


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
    discarded_late: int = 0
    """Of ``discarded``: members of a GRPO group ``discard_pending`` dropped that were reported
    after it, discarded on arrival (NOTE [ Duplicate window ])."""


@dataclass(frozen=True, slots=True)
class Shortfall:
    """What the open train batch lacks even if everything pending and in flight is accepted."""

    per_source: dict[str, int] = field(default_factory=dict)
    """Per quota'd source: trajectories its lower bound (in whole GRPO groups) still misses."""
    any_source: int = 0
    """Trajectories still missing to fill the batch once those are found, from any of
    ``open_sources``."""
    open_sources: tuple[str, ...] = ()
    """Sources that can still add to the batch: no upper bound, or one (in whole groups) above
    what they would have. More of any other source cannot help."""

    def __bool__(self) -> bool:
        return self.any_source > 0 or any(self.per_source.values())


class AdmissionController:
    """Admits mini-batches from reported trajectories so each train batch meets its quotas.

    ``next_minibatch`` admits the t-th mini-batch iff every readiness target tau_{i,t} holds
    (eq. 3), the selection policy proposes a candidate, and the feasibility guard holds on it
    (eq. 4, one guard over every source quota); admission is irrevocable (eq. 5). Reports and
    readiness checks cost O(#sources): the ready pool keeps per-source queues and counters.

    The controller holds no lock: call ``report``, ``issued`` and ``next_minibatch`` from one
    thread (the trainer's rollout loop, or one actor that owns it); a failed call raises before
    changing state, so the caller may log and continue. ``state_dict`` / ``load_state_dict``
    save and restore everything it holds (torch's convention).
    """

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._quotas, self.minibatch_sizes = resolve(config)
        self._bounds = {q.source: q.groups for q in self._quotas} if config.enforce_quotas else {}
        """Each enforced quota's bounds in whole GRPO groups (NOTE [ Bounds in whole groups ])."""
        self._size_targets = [
            math.ceil(a * config.train_batch_size - 1e-9)
            for a in config.size_schedule.alphas(config.num_minibatches)
        ]
        self._predicate_alphas = [
            p.schedule.alphas(config.num_minibatches) for p in config.predicates
        ]
        self._fingerprint = state.fingerprint(config, self._quotas)
        self._pool = ReadyPool(config.sources, track_versions=config.max_staleness is not None)
        self._pending_ids: set[str] = set()
        """Ids in the pool and in incomplete groups."""
        self._recent = RecentWindow()
        """Ids settled, and groups discarded, in the open and the previous train batch: with
        the pending ids, what a duplicate report is checked against (NOTE [ Duplicate window ])."""
        self._open_groups: dict[tuple[str, str], list[TrajectoryMeta]] = {}
        """Incomplete GRPO groups by (source, sample_id): datasets number prompts per source."""
        self._completed_by_step: Counter[int] = Counter()
        self._issued_by_step: Counter[int] = Counter()
        self._seq = 0
        self.stats = AdmissionStats()
        self.train_batch = 0
        self._t = 0
        self._admitted: dict[str, int] = dict.fromkeys(config.sources, 0)
        self._admitted_total = 0
        self._open_minibatches: list[tuple[TrajectoryMeta, ...]] = []
        """The trajectories of each mini-batch admitted into the open train batch."""
        self._last: MiniBatch | None = None
        self._newest_version: int | None = None
        """Newest policy version any reported token was generated with."""
        self._starts: dict[str, float] = {}
        """s_{i,0} per source quota: its count when the train batch opened, capped at tau_i."""
        self._quota_targets: list[list[tuple[str, int]]] = []
        self._open_view = AdmissionView(0, 1, {}, {})
        """Counts when the open train batch opened (issues live); read when predicates exist."""
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
        checks.whole(rollout_step, "issued(): rollout_step")
        checks.whole(count, "issued(): count")
        self._issued_by_step[int(rollout_step)] += int(count)

    def report(self, meta: TrajectoryMeta) -> None:
        """Record one completed trajectory; validates before changing any state."""
        self._check(meta)
        self._completed_by_step[meta.rollout_step] += 1
        self.stats.reported += 1
        if self._newest_version is None or meta.max_version > self._newest_version:
            self._newest_version = meta.max_version
        if self.config.group_size == 1:
            self._add((meta,))
            return
        key = (meta.source, meta.sample_id)
        group = self._open_groups.get(key)
        if group is None:
            if self._recent.late_member(key, meta.rollout_step):  # its group was discarded
                self.stats.discarded += 1
                self.stats.discarded_late += 1
                self._recent.settle((meta.trajectory_id,))
                return
            group = self._open_groups[key] = []
        group.append(meta)
        self._pending_ids.add(meta.trajectory_id)
        if len(group) == self.config.group_size:
            del self._open_groups[key]
            self._add(tuple(group))

    def _check(self, meta: TrajectoryMeta) -> None:
        tid = meta.trajectory_id
        if not isinstance(tid, str) or not tid:
            raise ValueError(f"trajectory_id={tid!r}: give a non-empty string")
        if meta.source not in self._pool.ready:
            raise ValueError(
                f"trajectory {tid!r}: unknown source {meta.source!r}; "
                f"configured sources: {self.config.sources}"
            )
        if tid in self._pending_ids or tid in self._recent:
            raise ValueError(f"trajectory {tid!r} was already reported")
        if not isinstance(meta.sample_id, str):
            raise ValueError(f"trajectory {tid!r}: sample_id={meta.sample_id!r}: give a string")
        if type(meta.accepted) is not bool:
            raise ValueError(f"trajectory {tid!r}: accepted={meta.accepted!r}: give True or False")
        step, tokens = meta.rollout_step, meta.num_tokens
        if not (  # the common case in one expression: plain ints, nothing negative
            type(step) is int
            and type(tokens) is int
            and type(meta.min_version) is int
            and type(meta.max_version) is int
            and step >= 0
            and tokens >= 0
        ):
            for name, minimum in _WHOLE_FIELDS:  # numpy ints pass; name what does not
                value = getattr(meta, name)
                if not checks.is_whole(value) or (minimum is not None and value < minimum):
                    raise ValueError(
                        f"trajectory {tid!r}: {name}={value!r}: give a whole number"
                        + ("" if minimum is None else f" >= {minimum}")
                    )
        group = self._open_groups.get((meta.source, meta.sample_id)) if self._open_groups else None
        if group and group[0].rollout_step != meta.rollout_step:
            raise ValueError(
                f"trajectory {tid!r}: GRPO group ({meta.source!r}, {meta.sample_id!r}) was issued "
                f"in rollout step {group[0].rollout_step}, this member says {meta.rollout_step}; "
                f"a group's members share source, sample_id and rollout step (give a prompt "
                f"issued again a new sample_id)"
            )

    def discard_pending(self) -> int:
        """Drop every pending trajectory (counted in ``stats.discarded``); returns how many.

        The open train batch's starting counts forget what was discarded, so its readiness
        targets never wait for trajectories that are gone. Members of a dropped incomplete
        GRPO group reported later are discarded on arrival (``stats.discarded_late``) while
        the duplicate window remembers the group (NOTE [ Duplicate window ]).
        """
        dropped = self._pool.clear()
        count = sum(u.size for u in dropped) + sum(len(g) for g in self._open_groups.values())
        g = self.config.group_size
        for key, members in self._open_groups.items():
            self._recent.discard_group(key, members[0].rollout_step, g - len(members))
        self._recent.settle(t.trajectory_id for u in dropped for t in u.trajectories)
        self._recent.settle(t.trajectory_id for m in self._open_groups.values() for t in m)
        self._pending_ids.clear()
        self._open_groups.clear()
        self.stats.discarded += count
        # s_{i,0} counted the discarded ready trajectories; what survives is what was admitted.
        self._starts = {s: min(v, float(self._admitted[s])) for s, v in self._starts.items()}
        self._set_targets()
        if self.config.predicates:
            ready = dict.fromkeys(self.config.sources, 0)
            self._open_view = dataclasses.replace(self._open_view, ready=ready)
        return count

    def _add(self, trajectories: tuple[TrajectoryMeta, ...]) -> None:
        """A complete unit: into the pool, or settled as rejected or stale."""
        if not all(t.accepted for t in trajectories):
            self.stats.rejected += len(trajectories)
            self._settle(trajectories)
            return
        unit = Unit.of(self._seq, trajectories[0].source, trajectories)
        self._seq += 1
        if self._is_stale(unit):
            self.stats.stale_dropped += unit.size
            self._settle(trajectories)
            return
        self._pool.push(unit)
        if len(trajectories) == 1:
            self._pending_ids.add(trajectories[0].trajectory_id)

    def _settle(self, trajectories: tuple[TrajectoryMeta, ...]) -> None:
        """They leave the pending state: the duplicate window remembers them."""
        ids = [t.trajectory_id for t in trajectories]
        self._pending_ids.difference_update(ids)
        self._recent.settle(ids)

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
            self._bounds, self._admitted, self._pool.ready, slots_after
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
        self._settle(trajectories)
        batch = self._last = MiniBatch(self.train_batch, t, trajectories)
        self._open_minibatches.append(trajectories)
        self._t += 1
        if self._t == self.config.num_minibatches:
            self.train_batch += 1
            self._t = 0
            self._admitted = dict.fromkeys(self.config.sources, 0)
            self._admitted_total = 0
            self._open_minibatches = []
            self._recent.rotate()
            if self.config.max_staleness is not None:
                oldest = self.training_version - self.config.max_staleness
                expired = self._pool.expire_older_than(oldest)
                self.stats.stale_dropped += sum(u.size for u in expired)
                self._settle(tuple(t for u in expired for t in u.trajectories))
            self._open_train_batch()
        return batch

    def _open_train_batch(self) -> None:
        """Snapshot s_{i,0} for every quota and predicate when a train batch opens."""
        ready = self._pool.ready
        self._starts = {q.source: float(min(ready[q.source], q.lower)) for q in self._quotas}
        self._set_targets()
        if self.config.predicates:
            self._open_view = AdmissionView(
                self.train_batch,
                1,
                dict(ready),
                dict(self._admitted),
                dict(self._completed_by_step),
                MappingProxyType(self._issued_by_step),
            )

    def _set_targets(self) -> None:
        # Starts are capped at tau_i (a start past the final target counts as the target), so
        # a target never exceeds tau_i and nothing the train batch does not need (such as
        # ready trajectories discarded since it opened) can hold it back.
        self._quota_targets = [
            [
                (q.source, math.ceil(start + q.alphas[t] * (q.lower - start) - 1e-9))
                for q in self._quotas
                for start in (self._starts[q.source],)
            ]
            for t in range(self.config.num_minibatches)
        ]

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
        return CandidateRequest(
            size=size,
            slots_after=self.config.train_batch_size - self._admitted_total - size,
            bounds=self._bounds,
            admitted=MappingProxyType(self._admitted),
            guarded=guarded,
        )

    def shortfall(self, in_flight: Mapping[str, int] | None = None) -> Shortfall:
        """What the open train batch still lacks if every pending and ``in_flight`` trajectory
        (per source: issued, not yet reported) were accepted: what a rollout loop must issue
        more of, e.g. under dynamic sampling's group filtering. Empty when it can complete."""
        flying = in_flight or {}
        have = self._pending_per_source()
        for source in have:
            have[source] += self._admitted[source] + int(flying.get(source, 0))
        bounds = self._bounds
        need = {s: n for s, b in bounds.items() if (n := b.deficit(have[s]))}
        filled, open_sources = 0, []
        for source, count in have.items():
            bound = bounds.get(source)
            count += need.get(source, 0)
            filled += count if bound is None else bound.usable(count)
            if bound is None or bound.room(count):
                open_sources.append(source)
        missing = max(0, self.config.train_batch_size - filled)
        return Shortfall(need, missing, tuple(open_sources) if missing else ())

    def _pending_per_source(self) -> dict[str, int]:
        pending = dict(self._pool.ready)
        for (source, _), members in self._open_groups.items():
            pending[source] += len(members)
        return pending

    def metrics(self) -> dict[str, float]:
        """Run figures, flat, namespaced ``knitkit/admission/...`` (plain floats):

        - ``pending`` and ``pending/<source>``: accepted, not yet admitted (ready or in an
          incomplete group); ``ready/<source>``: ready units' trajectories.
        - cumulative counters: ``reported``, ``admitted``, ``rejected``, ``stale_dropped``,
          ``discarded`` (of which ``discarded_late``: members of discarded groups reported after
          ``discard_pending()``), ``minibatches_admitted``.
        - the open train batch: ``train_batch`` (its index), ``minibatch`` (mini-batches
          admitted into it), ``admitted/<source>``; per source quota ``quota/<source>/count``
          (admitted), ``quota/<source>/target`` (final lower bound tau_i) and
          ``quota/<source>/next_target`` (readiness target of the next mini-batch).
        - the last admitted mini-batch: ``last_minibatch/size`` and, in versions behind the
          version it trains at, ``last_minibatch/staleness_mean`` (oldest token per trajectory)
          and ``last_minibatch/staleness_max``; ``training_version``; ``rollout_version`` (the
          newest version any reported token was generated with; absent before a report).
        """
        p = "knitkit/admission/"
        out: dict[str, float] = {f"{p}pending": float(self.pending)}
        pending = self._pending_per_source()
        for source in self.config.sources:
            out[f"{p}pending/{source}"] = float(pending[source])
            out[f"{p}ready/{source}"] = float(self._pool.ready[source])
            out[f"{p}admitted/{source}"] = float(self._admitted[source])
        for counter in dataclasses.fields(AdmissionStats):
            out[p + counter.name] = float(getattr(self.stats, counter.name))
        out[f"{p}minibatches_admitted"] = float(
            self.train_batch * self.config.num_minibatches + self._t
        )
        out[f"{p}train_batch"] = float(self.train_batch)
        out[f"{p}minibatch"] = float(self._t)
        for (source, target), q in zip(self._quota_targets[self._t], self._quotas, strict=True):
            out[f"{p}quota/{source}/count"] = float(self._admitted[source])
            out[f"{p}quota/{source}/target"] = float(q.lower)
            out[f"{p}quota/{source}/next_target"] = float(target)
        out[f"{p}training_version"] = float(self.training_version)
        if self._newest_version is not None:
            out[f"{p}rollout_version"] = float(self._newest_version)
        if self._last is not None:
            version = self.config.initial_version + self._last.train_batch
            behind = [version - t.min_version for t in self._last.trajectories]
            out[f"{p}last_minibatch/size"] = float(len(behind))
            out[f"{p}last_minibatch/staleness_mean"] = sum(behind) / len(behind)
            out[f"{p}last_minibatch/staleness_max"] = float(max(behind))
        return out

    def snapshot(self) -> state.AdmissionSnapshot:
        """A consistent copy of everything this controller holds, cheap to take: it copies
        references, O(pending + the duplicate window), so a caller holding a lock around the
        controller holds it only that long and encodes outside it
        (``snapshot().state_dict()``; see NOTE [ Admission state ])."""
        last = self._last
        return state.AdmissionSnapshot(
            fingerprint=self._fingerprint,
            stats=dataclasses.asdict(self.stats),
            seq=self._seq,
            train_batch=self.train_batch,
            minibatch=self._t,
            admitted=dict(self._admitted),
            starts=dict(self._starts),
            ledger=list(self._open_minibatches),
            open_ready={s: self._open_view.ready.get(s, 0) for s in self.config.sources},
            open_completed=dict(self._open_view.completed_by_step),
            completed=dict(self._completed_by_step),
            issued=dict(self._issued_by_step),
            newest_version=self._newest_version,
            last=None if last is None else (last.train_batch, last.index, last.trajectories),
            queues=self._pool.queues(),
            groups=[tuple(g) for g in self._open_groups.values()],
            recent=self._recent.copy(),
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything this controller holds, as plain JSON-ready data (torch's convention):
        the pool, incomplete GRPO groups, the duplicate window, counters, the open train batch
        (index, admitted and starting counts, each admitted mini-batch's trajectories) and the
        versions, with the config's fingerprint. ``snapshot().state_dict()``; see NOTE
        [ Admission state ]."""
        return self.snapshot().state_dict()

    # NOTE [ Loading with the collector paused ]: restoring a million pending trajectories
    # builds millions of small acyclic objects (their metadata, units, the pool's tables); with
    # CPython's collector on, each quarter the heap grows by triggers a full collection over
    # all of it, 45% of the load's CPU (1.03 s against 0.58 s paused, at 300k pending, measured
    # by hand with benchmarks/checkpoint.py's controller). So the load pauses the collector,
    # through the same process-wide count as the planner
    # (NOTE [ Planner and the garbage collector ]): the first pause in switches it off, the
    # last one out back on if it was on. The objects are scanned once, at the first collection
    # after the call.
    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``'s output. A state saved under a different config is refused
        naming each difference, a malformed one naming the field, one that breaks an invariant
        the controller keeps (a pool unit missing, an id twice, counters that do not add up...)
        naming the invariant; either way nothing changes."""
        c = self.config
        fields = [f.name for f in dataclasses.fields(AdmissionStats)]
        shape = Shape(
            sources=tuple(c.sources),
            quotas=self._quotas,
            train_batch_size=c.train_batch_size,
            minibatch_sizes=self.minibatch_sizes,
            group_size=c.group_size,
            guarded=c.enforce_quotas and c.guards,
            enforce_quotas=c.enforce_quotas,
            max_staleness=c.max_staleness,
            initial_version=c.initial_version,
        )
        with collector_paused():  # see NOTE [ Loading with the collector paused ]
            r = read_state(saved, self._fingerprint, fields, shape)
            pool = ReadyPool(c.sources, track_versions=c.max_staleness is not None)
            pool.fill(r.units)
        # Everything is read and checked; from here on nothing can fail.
        self.stats = AdmissionStats(**r.counters)
        self._seq, self._pool, self._open_groups = r.seq, pool, r.groups
        self._pending_ids, self._recent = r.pending_ids, r.recent
        self._completed_by_step, self._issued_by_step = r.completed, r.issued
        self.train_batch, self._t = r.train_batch, r.minibatch
        self._admitted, self._admitted_total = r.admitted, sum(r.admitted.values())
        self._open_minibatches, self._newest_version = r.ledger, r.newest_version
        self._last = None if r.last is None else MiniBatch(*r.last)
        self._open_view = AdmissionView(
            r.train_batch,
            1,
            r.open_ready,
            dict.fromkeys(c.sources, 0),
            r.open_completed,
            MappingProxyType(self._issued_by_step),
        )
        self._starts = r.starts
        self._set_targets()
