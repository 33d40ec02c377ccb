"""What a replay run records, and the per-step staleness, violation and skew figures derived from it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from knitkit.admission.replay.rollout import Job


@dataclass(slots=True)
class RunRecord:
    """Raw outcome of one simulated run (one architecture, one policy, one trace)."""

    step_start: dict[int, float] = field(default_factory=dict)
    """Rollout step k's issue time (rollout step k feeds train batch k)."""
    admit_time: dict[tuple[int, int], float] = field(default_factory=dict)
    """(train batch, mini-batch index) -> admission time."""
    minibatch_mix: dict[tuple[int, int], Counter[str]] = field(default_factory=dict)
    start_staleness: dict[int, list[float]] = field(default_factory=dict)
    """Per train batch: staleness of each trajectory's oldest token."""
    token_staleness: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    """Per train batch: (token-mean staleness, tokens) of each trajectory."""
    source_staleness: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)
    """Per source: (train batch, token-mean staleness, tokens) of each trajectory."""
    busy_s: dict[int, float] = field(default_factory=dict)
    """Per train batch: trainer busy seconds."""
    train_end: dict[int, float] = field(default_factory=dict)
    """Per train batch: when its last mini-batch finished training."""
    dropped: int = 0
    """Trajectories discarded unfinished or unadmitted (colocated without partial rollout)."""

    def admit(self, train_batch: int, index: int, now: float, sources: list[str]) -> None:
        self.admit_time[(train_batch, index)] = now
        self.minibatch_mix[(train_batch, index)] = Counter(sources)

    def train(self, train_batch: int, jobs: list[Job]) -> None:
        """Record the staleness of ``jobs`` trained in ``train_batch`` (training version = index)."""
        starts = self.start_staleness.setdefault(train_batch, [])
        tokens = self.token_staleness.setdefault(train_batch, [])
        for job in jobs:
            versions = [v for v, _ in job.segments] or [job.version]
            starts.append(float(train_batch - min(versions)))
            work = sum(s for _, s in job.segments)
            # A 0 s trajectory has no segment; its tokens carry the version it ran at, the limit
            # of ever shorter ones (counting it as staleness 0 made the metric jump at 0 s).
            mean = (
                sum((train_batch - v) * s for v, s in job.segments) / work
                if work > 0
                else float(train_batch - job.version)
            )
            tokens.append((mean, job.record.tokens or 1))
            self.source_staleness.setdefault(job.record.source, []).append(
                (train_batch, mean, job.record.tokens or 1)
            )

    def per_step(self, token_weighted: bool) -> dict[int, float]:
        if not token_weighted:
            return {k: float(np.mean(v)) for k, v in sorted(self.start_staleness.items())}
        out = {}
        for k, pairs in sorted(self.token_staleness.items()):
            weights = np.array([w for _, w in pairs], dtype=float)
            out[k] = float(np.dot([m for m, _ in pairs], weights) / weights.sum())
        return out

    def per_source(self, batches: range) -> dict[str, float]:
        """Token-weighted mean staleness per source over the train batches in ``batches``."""
        out = {}
        for source, rows in sorted(self.source_staleness.items()):
            kept = [(m, w) for k, m, w in rows if k in batches]
            if kept:
                weight = sum(w for _, w in kept)
                out[source] = sum(m * w for m, w in kept) / weight
        return out

    def batch_counts(self, train_batch: int, num_minibatches: int) -> Counter[str]:
        total: Counter[str] = Counter()
        for t in range(num_minibatches):
            total.update(self.minibatch_mix.get((train_batch, t), Counter()))
        return total


def violations(
    record: RunRecord,
    batches: range,
    num_minibatches: int,
    bounds: dict[str, tuple[int, int | None]],
) -> list[int]:
    """Per train batch in ``batches``: trajectories missing from lower bounds plus excess over upper ones."""
    out = []
    for k in batches:
        counts = record.batch_counts(k, num_minibatches)
        out.append(
            sum(
                max(0, lo - counts.get(s, 0)) + (0 if hi is None else max(0, counts.get(s, 0) - hi))
                for s, (lo, hi) in bounds.items()
            )
        )
    return out


def mix_skew(
    record: RunRecord, batches: range, num_minibatches: int, target: dict[str, float]
) -> float:
    """Mean total-variation distance between each mini-batch's source mix and ``target`` shares."""
    distances = []
    for k in batches:
        for t in range(num_minibatches):
            mix = record.minibatch_mix.get((k, t))
            if not mix:
                continue
            n = sum(mix.values())
            sources = set(mix) | set(target)
            distances.append(
                0.5 * sum(abs(mix.get(s, 0) / n - target.get(s, 0.0)) for s in sources)
            )
    return float(np.mean(distances)) if distances else 0.0


def first_minibatch_fraction(record: RunRecord, batches: range, num_minibatches: int) -> float:
    """Mean share of (rollout-step start -> final admission) elapsed before mini-batch 1 is admitted."""
    fractions = []
    for k in batches:
        start, first = record.step_start.get(k), record.admit_time.get((k, 0))
        last = record.admit_time.get((k, num_minibatches - 1))
        if start is None or first is None or last is None or last <= start:
            continue
        fractions.append(min(1.0, max(0.0, (first - start) / (last - start))))
    return float(np.mean(fractions)) if fractions else float("nan")
