"""A clairvoyant offline optimum for one train batch, and the regret of online policies against it."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from knitkit.admission.policies import build_controller
from knitkit.admission.predicates import SourceQuota
from knitkit.admission.replay.settings import Preset
from knitkit.types import TrajectoryMeta


@dataclass(frozen=True, slots=True)
class BatchWindow:
    """One train batch's completions (time, source), known in full to the oracle only."""

    arrivals: tuple[tuple[float, str], ...]
    train_batch_size: int
    num_minibatches: int
    quotas: tuple[SourceQuota, ...]
    minibatch_s: float
    """Training time of one mini-batch."""

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(sorted({s for _, s in self.arrivals}))


def offline_optimum(window: BatchWindow) -> float:
    """Earliest possible end of training of the train batch (its sync time), by exact DP.

    The oracle picks each mini-batch's composition knowing every completion time: state is
    the cumulative count per source; mini-batch t is admitted once its last unit completed and
    trained after the previous one. Only the final composition must meet the quotas (which
    implies every guard). Exponential in the number of sources: meant for small traces.
    """
    sources = window.sources
    times = {s: sorted(t for t, src in window.arrivals if src == s) for s in sources}
    bounds = {q.source: q.bounds(window.train_batch_size) for q in window.quotas}
    size = window.train_batch_size // window.num_minibatches
    best: dict[tuple[int, ...], float] = {(0,) * len(sources): 0.0}
    for _ in range(window.num_minibatches):
        step: dict[tuple[int, ...], float] = {}
        for counts, finish in best.items():
            for add in _compositions(size, len(sources)):
                new = tuple(c + a for c, a in zip(counts, add, strict=True))
                if any(n > len(times[s]) for n, s in zip(new, sources, strict=True)):
                    continue
                ready = max(
                    (times[s][n - 1] for n, s in zip(new, sources, strict=True) if n), default=0.0
                )
                end = max(ready, finish) + window.minibatch_s
                if end < step.get(new, np.inf):
                    step[new] = end
        best = step
    feasible = [
        end
        for counts, end in best.items()
        if all(
            lo <= counts[sources.index(s)] and (hi is None or counts[sources.index(s)] <= hi)
            for s, (lo, hi) in bounds.items()
            if s in sources
        )
    ]
    if not feasible:
        raise ValueError("the window's completions cannot meet the quotas; add arrivals")
    return min(feasible)


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        edges = (-1, *cuts, total + parts - 1)
        out.append(tuple(edges[i + 1] - edges[i] - 1 for i in range(parts)))
    return out


def online_finish(policy: str, window: BatchWindow) -> float:
    """End of training of the train batch when ``policy`` admits online from the same completions."""
    ctl = build_controller(
        policy,
        train_batch_size=window.train_batch_size,
        num_minibatches=window.num_minibatches,
        sources=window.sources,
        quotas=window.quotas,
    )
    finish = 0.0
    admitted = 0
    for k, (time, source) in enumerate(sorted(window.arrivals)):
        ctl.report(TrajectoryMeta(f"t{k}", f"s{k}", source, 0, 1, 0, 0))
        while admitted < window.num_minibatches and ctl.next_minibatch() is not None:
            finish = max(finish, time) + window.minibatch_s
            admitted += 1
    if admitted < window.num_minibatches:
        raise ValueError(f"policy {policy!r} did not complete the train batch on this window")
    return finish


def random_window(
    rng: np.random.Generator, means: Mapping[str, float], quota_ratio: float, batch: int, n: int
) -> BatchWindow:
    """A small skewed window: 1.25x the batch issued evenly, log-normal durations (sigma 0.5)."""
    per_source = int(np.ceil(1.25 * batch / len(means)))
    arrivals = tuple(
        (float(mean * rng.lognormal(0.0, 0.5)), source)
        for source, mean in means.items()
        for _ in range(per_source)
    )
    quotas = tuple(SourceQuota(source=s, min_ratio=quota_ratio) for s in means)
    return BatchWindow(arrivals, batch, n, quotas, minibatch_s=0.25 * max(means.values()) / n)


def regret_study(
    policies: Sequence[str], *, windows: int = 20, batch: int = 20, n: int = 4, seed: int = 0
) -> dict[str, float]:
    """Mean (policy finish - oracle finish) / oracle finish over random small windows, per policy."""
    rng = np.random.default_rng(seed)
    means = {"A": 1.0, "B": 2.0, "C": 4.0, "D": 8.0}
    totals = dict.fromkeys(policies, 0.0)
    for _ in range(windows):
        window = random_window(rng, means, 0.2, batch, n)
        best = offline_optimum(window)
        for policy in policies:
            totals[policy] += (online_finish(policy, window) - best) / best
    return {p: v / windows for p, v in totals.items()}


def family_regret(
    family: Preset,
    policies: Sequence[str],
    *,
    windows: int = 8,
    batch: int = 20,
    n: int = 4,
    seed: int = 0,
) -> dict[str, float]:
    """Mean relative regret per policy on small windows drawn from a trace family's sources.

    Each window issues 1.25x a ``batch`` by the family's issue shares, with durations drawn from
    its source profiles and its quota ratios applied to ``batch`` (completion quotas, being
    about rollout steps, are left out of a one-batch window).
    """
    rng = np.random.default_rng(seed)
    profiles = family.profiles
    shares = family.settings.issue_shares or {p.name: 1.0 / len(profiles) for p in profiles}
    quotas = family.settings.quotas()
    slowest = max(p.median_s for p in profiles)
    totals = dict.fromkeys(policies, 0.0)
    for _ in range(windows):
        arrivals = tuple(
            (
                float(min(p.median_s * rng.lognormal(0.0, p.sigma), p.cap_factor * p.median_s)),
                p.name,
            )
            for p in profiles
            for _ in range(int(np.ceil(1.25 * batch * shares.get(p.name, 0.0))))
        )
        window = BatchWindow(arrivals, batch, n, quotas, minibatch_s=0.25 * slowest / n)
        best = offline_optimum(window)
        for policy in policies:
            totals[policy] += (online_finish(policy, window) - best) / best
    return {p: v / windows for p, v in totals.items()}
