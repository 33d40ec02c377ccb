"""Replay a trace under several admission policies and summarise architectural staleness per policy."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from knitkit.admission.policies import POLICY_NAMES
from knitkit.admission.predicates import SourceQuota
from knitkit.admission.replay.metrics import (
    RunRecord,
    first_minibatch_fraction,
    mix_skew,
    violations,
)
from knitkit.admission.replay.settings import ReplaySettings, preset
from knitkit.admission.replay.simulate import run_colocated, run_disaggregated
from knitkit.admission.replay.trace import Trace

Summary = dict[str, Any]


class ProgressBar:
    """Progress on stderr: a redrawn bar on a terminal (or when forced), else one line per
    finished run, so logs and pipes see progress without carriage returns."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, force: bool = False):
        self.total, self.label, self.done = total, label, 0
        self.stream = stream or sys.stderr
        self.enabled = force or self.stream.isatty()
        self._start = time.perf_counter()

    def advance(self, steps: int = 1) -> None:
        """Count ``steps`` more train batches replayed."""
        self.done = min(self.total, self.done + steps)
        if self.enabled:
            filled = round(30 * self.done / max(1, self.total))
            self.stream.write(
                f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
            )
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()

    def finished(self, run: str) -> None:
        """Say that ``run`` (the colocated reference or a policy) is done, when not drawing."""
        if not self.enabled:
            elapsed = time.perf_counter() - self._start
            self.stream.write(
                f"{self.label}: {run} done ({self.done}/{self.total} train batches, "
                f"{elapsed:.1f} s)\n"
            )
            self.stream.flush()


def rollout_step_length(colocated: RunRecord, settings: ReplaySettings) -> float:
    """Mean colocated rollout-step length after warm-up: the yardstick for rho."""
    steps = range(settings.warmup, settings.train_batches)
    return float(np.mean([colocated.train_end[k] - colocated.step_start[k] for k in steps]))


def staleness_drift(series: Sequence[float]) -> float:
    """Mean of the last third minus mean of the first third: ~0 when staleness is stationary."""
    third = max(1, len(series) // 3)
    return float(np.mean(series[-third:]) - np.mean(series[:third]))


def run_replay(
    trace: Trace,
    settings: ReplaySettings,
    policies: Sequence[str] = POLICY_NAMES,
    progress: ProgressBar | None = None,
) -> Summary:
    """Replay ``trace`` colocated once and disaggregated under each policy; return the summary dict.

    ``summary["policies"][name]`` holds ``architectural_staleness`` (token-weighted, disaggregated
    minus colocated, mean over the steps after warm-up), ``architectural_staleness_start``
    (oldest-token), ``drift`` (last third minus first third of the per-step series: a steady
    state has ~0), ``violations`` (train batches missing a quota), ``shortfall_per_step``
    (trajectories short of the quotas per train batch), ``steps``, per-step series,
    ``mix_skew``, ``first_minibatch_fraction`` and ``trainer_idle_fraction``.
    """
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICY_NAMES)}")
    if not policies:
        raise ValueError(f"no policy to replay; choose from {', '.join(POLICY_NAMES)}")
    check_feedable(trace, settings)
    tick = progress.advance if progress else None
    colocated = run_colocated(trace, settings, tick)
    if progress:
        progress.finished("colocated")
    step_length = rollout_step_length(colocated, settings)
    train_time = settings.rho * step_length
    steps = range(settings.warmup, settings.train_batches)
    base_tok, base_start = colocated.per_step(True), colocated.per_step(False)
    base_source = colocated.per_source(steps)
    bounds = {q.source: q.bounds(settings.train_batch_size) for q in settings.quotas()}
    lower_total = sum(lo for lo, _ in bounds.values()) or 1
    target_mix = {s: lo / lower_total for s, (lo, _) in bounds.items()}
    n = settings.num_minibatches
    out: dict[str, Summary] = {}
    for policy in policies:
        run = run_disaggregated(trace, settings, policy, train_time, tick)
        if progress:
            progress.finished(policy)
        tok, start = run.per_step(True), run.per_step(False)
        shortfall = violations(run, steps, n, bounds)
        span = run.train_end[steps[-1]] - run.train_end[steps[0] - 1]
        busy = sum(run.busy_s[k] for k in steps)
        series = [tok[k] - base_tok[k] for k in steps]
        out[policy] = {
            "architectural_staleness": float(np.mean(series)),
            "drift": staleness_drift(series),
            "staleness_per_source": {
                s: v - base_source.get(s, 0.0) for s, v in run.per_source(steps).items()
            },
            "architectural_staleness_start": float(
                np.mean([start[k] - base_start[k] for k in steps])
            ),
            "violations": sum(1 for v in shortfall if v),
            "shortfall_per_step": shortfall,
            "steps": len(steps),
            "staleness_per_step": series,
            "mix_skew": mix_skew(run, steps, n, target_mix),
            "first_minibatch_fraction": first_minibatch_fraction(run, steps, n),
            "trainer_idle_fraction": max(0.0, 1.0 - busy / span) if span > 0 else 0.0,
            "seconds_per_step": span / len(steps),
            "composition_per_step": [
                {
                    s: c / settings.train_batch_size
                    for s, c in sorted(run.batch_counts(k, n).items())
                }
                for k in steps
            ],
            "admission_times": [
                [run.admit_time[(k, t)] - run.step_start[k] for t in range(n)] for k in steps
            ],
        }
    return {
        "policies": out,
        "rho": settings.rho,
        "train_time_s": train_time,
        "rollout_step_s": step_length,
        "colocated_staleness": float(np.mean([base_tok[k] for k in steps])),
        "colocated_dropped": colocated.dropped,
        "settings": settings_block(settings, trace),
    }


def check_feedable(trace: Trace, settings: ReplaySettings) -> None:
    """Refuse settings the trace can never feed: issue shares or quotas naming a source it does
    not have, or a lower-bounded source that is never issued."""
    shares = settings.issue_shares
    unknown = sorted(set(shares or {}) - set(trace.sources))
    if unknown:
        raise ValueError(
            f"issue shares name {unknown}, not in the trace; sources: {list(trace.sources)}"
        )
    for quota in settings.quotas():
        if quota.source not in trace.sources:
            raise ValueError(
                f"quota {quota.source!r} names a source not in the trace; "
                f"sources: {list(trace.sources)}"
            )
        lower, _ = quota.bounds(settings.train_batch_size)
        if lower and shares is not None and not shares.get(quota.source):
            raise ValueError(
                f"quota {quota.source!r} needs {lower} trajectories per train batch but its "
                f"issue share is 0: give it a share (--issue-shares)"
            )


def settings_block(settings: ReplaySettings, trace: Trace) -> dict[str, Any]:
    """Every replay setting (JSON-ready), enough with the trace to reproduce the run."""
    block: dict[str, Any] = {
        f.name: getattr(settings, f.name) for f in dataclasses.fields(ReplaySettings)
    }
    block["quota_ratios"] = dict(settings.quota_ratios)
    block["quota_max_ratios"] = dict(settings.quota_max_ratios)
    block["issue_shares"] = None if settings.issue_shares is None else dict(settings.issue_shares)
    block["quota_specs"] = [
        {k: v for k, v in quota_fields(q).items() if v is not None} for q in settings.quota_specs
    ]
    block["quotas"] = {
        q.source: dict(zip(("lower", "upper"), q.bounds(settings.train_batch_size), strict=True))
        for q in settings.quotas()
    }
    block["num_minibatches"] = settings.num_minibatches
    block["sources"] = list(trace.sources)
    block["group_size"] = trace.group_size
    return block


def quota_fields(quota: SourceQuota) -> dict[str, Any]:
    """A quota as the plain fields ``--quotas-file`` takes (its schedule left out)."""
    return {
        "min_count": quota.min_count,
        "min_ratio": quota.min_ratio,
        "max_count": quota.max_count,
        "max_ratio": quota.max_ratio,
        "group": quota.group,
    }


def replay_preset(
    name: str = "paper4", policies: Sequence[str] = POLICY_NAMES, **settings: Any
) -> Summary:
    """Replay a named preset (``settings`` override ``ReplaySettings`` fields); return the summary."""
    chosen = preset(name)
    replay_settings = chosen.settings.with_(**settings)
    return run_replay(chosen.trace(replay_settings), replay_settings, policies)
