"""The replay simulator's sanity cases: colocated zero, ideal 1 and 1/n, determinism, common randomness."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from knitkit.admission.replay import (
    ReplaySettings,
    SourceProfile,
    Trace,
    TraceRecord,
    generate_trace,
    preset,
    run_replay,
)
from knitkit.admission.replay.rollout import EventQueue, RolloutPool
from knitkit.admission.replay.simulate import run_colocated


def constant_trace(per_source: int = 2000) -> Trace:
    return Trace(
        {
            s: tuple(TraceRecord(s, f"{s}{k}", 10.0, 100) for k in range(per_source))
            for s in ("A", "B")
        }
    )


def test_colocated_without_partial_rollout_is_exactly_zero() -> None:
    """Colocated rollout at version k trains batch k; with nothing carried over, staleness is 0."""
    chosen = preset("paper4")
    settings = chosen.settings.with_(partial_rollout="off", train_batches=8, warmup=2)
    record = run_colocated(chosen.trace(settings), settings)
    assert set(record.per_step(True).values()) == {0.0}
    assert set(record.per_step(False).values()) == {0.0}
    assert record.dropped > 0  # unfinished and surplus trajectories were discarded, and counted


@pytest.mark.parametrize("minibatches", [4, 8])
def test_zero_variance_gives_one_and_one_over_n(minibatches: int) -> None:
    """Constant durations, rollout one mini-batch ahead, rho = 1: barrier ~1, mini-batch(n) ~1/n."""
    settings = ReplaySettings(
        train_batch_size=16,
        num_minibatches=minibatches,
        quota_ratios={"A": 0.5, "B": 0.5},
        oversample=0.0,
        source_cap=4.0,
        rollout_slots=16 // minibatches,
        rho=1.0,
        train_batches=20,
        warmup=4,
    )
    summary = run_replay(constant_trace(), settings, ["barrier", "linear", "knittrans", "adaptive"])
    assert summary["colocated_staleness"] == 0.0
    policies = summary["policies"]
    assert policies["barrier"]["architectural_staleness"] == pytest.approx(1.0, abs=0.02)
    for name in ("linear", "knittrans", "adaptive"):
        assert policies[name]["architectural_staleness"] == pytest.approx(1 / minibatches, abs=0.02)


def test_same_seed_same_result_and_seed_matters() -> None:
    """A replay is a pure function of (trace seed, settings)."""
    chosen = preset("paper4")
    settings = chosen.settings.with_(train_batches=8, warmup=2)
    first = run_replay(chosen.trace(settings), settings, ["knittrans"])
    again = run_replay(chosen.trace(settings), settings, ["knittrans"])
    other = chosen.settings.with_(train_batches=8, warmup=2, seed=1)
    assert first == again
    assert run_replay(chosen.trace(other), other, ["knittrans"]) != first


def test_kth_issue_of_a_source_replays_record_k() -> None:
    """Common random numbers: whatever the policy, source s's k-th issued trajectory is record k."""
    trace = Trace(
        {
            "A": tuple(TraceRecord("A", f"a{k}", float(k + 1)) for k in range(8)),
            "B": tuple(TraceRecord("B", f"b{k}", float(100 + k)) for k in range(8)),
        }
    )
    pool = RolloutPool(trace, slots=2, events=EventQueue(), on_finish=lambda job: None)
    pool.issue(0, {"A": 2, "B": 1})
    pool.issue(1, {"A": 1, "B": 2})
    issued = [(j.trajectory_id, j.record.duration_s) for j in pool.queue]
    assert issued == [
        ("A#0", 1.0),
        ("B#0", 100.0),
        ("A#1", 2.0),
        ("A#2", 3.0),
        ("B#1", 101.0),
        ("B#2", 102.0),
    ]


def test_bad_settings_fail_clearly() -> None:
    """Unknown partial-rollout modes and warm-up longer than the run are refused."""
    with pytest.raises(ValueError, match="partial_rollout='sometimes'"):
        ReplaySettings(partial_rollout="sometimes")
    with pytest.raises(ValueError, match="must exceed warmup"):
        ReplaySettings(train_batches=4, warmup=6)


def test_every_policy_reaches_a_steady_state_and_drift_is_reported() -> None:
    """With rollout able to outrun training (oversampling, loose caps), staleness stays
    stationary for every policy, baselines included: the trainer pulls mini-batches and a
    rollout step tops each source up instead of piling a full step on the leftovers."""
    profiles = (
        SourceProfile(name="A", median_s=20.0, sigma=0.8),
        SourceProfile(name="B", median_s=60.0, sigma=0.8),
    )
    settings = ReplaySettings(
        train_batch_size=64,
        quota_ratios={"A": 0.4, "B": 0.4},
        rollout_slots=256,
        rho=0.8,
        oversample=0.5,
        source_cap=2.0,
        train_batches=45,
        warmup=3,
    )
    trace = generate_trace(profiles, samples_per_source=8000, group_size=1, seed=0)
    summary = run_replay(trace, settings)
    drifts = {}
    for name, entry in summary["policies"].items():
        series = entry["staleness_per_step"]
        third = len(series) // 3
        drifts[name] = sum(series[-third:]) / third - sum(series[:third]) / third
    assert all(abs(d) < 0.3 for d in drifts.values()), drifts
    for name, entry in summary["policies"].items():
        assert entry["drift"] == pytest.approx(drifts[name])


def test_staleness_is_continuous_at_zero_duration() -> None:
    """A 0 s trajectory's tokens carry the version it ran at, the limit of ever shorter ones:
    setting one source's durations to 0 s or to 1e-9 s gives the same figures (issue 25: a 0 s
    trajectory counted as staleness 0 whatever its version)."""
    chosen = preset("paper4")
    settings = chosen.settings.with_(train_batches=10, warmup=3)
    trace = chosen.trace(settings)

    def replay(duration: float) -> dict:
        records = dict(trace.records)
        records["A"] = tuple(dataclasses.replace(r, duration_s=duration) for r in records["A"])
        return run_replay(Trace(records, trace.group_size), settings, ("linear", "knittrans"))

    zero, tiny = replay(0.0), replay(1e-9)
    assert zero["colocated_staleness"] == pytest.approx(tiny["colocated_staleness"], abs=1e-6)
    for name, entry in zero["policies"].items():
        other = tiny["policies"][name]
        assert entry["architectural_staleness"] == pytest.approx(
            other["architectural_staleness"], abs=1e-6
        )
        for source, value in entry["staleness_per_source"].items():
            assert value == pytest.approx(other["staleness_per_source"][source], abs=1e-6)


def rejecting_trace(
    share: float, seed: int = 0, per_source: dict[str, float] | None = None
) -> Trace:
    """Three sources in GRPO groups of 8 whose groups are rejected whole with probability
    ``share`` (``per_source`` overrides it per source), as dynamic sampling filters them."""
    profiles = (
        SourceProfile(name="A", median_s=20.0, sigma=0.6),
        SourceProfile(name="B", median_s=60.0, sigma=0.6),
        SourceProfile(name="C", median_s=100.0, sigma=0.3),
    )
    base = generate_trace(profiles, samples_per_source=1500, group_size=8, seed=seed)
    rng = np.random.default_rng(seed)
    records = {}
    for source, rows in base.records.items():
        reject = (per_source or {}).get(source, share)
        keep = rng.random(len(rows) // 8) >= reject
        records[source] = tuple(
            dataclasses.replace(r, accepted=bool(keep[k // 8])) for k, r in enumerate(rows)
        )
    return Trace(records, 8)


@pytest.mark.parametrize(("oversample", "atomic"), [(0.0, True), (0.0, False), (1.0, False)])
def test_dynamic_sampling_fills_train_batches_when_40_percent_of_groups_are_rejected(
    oversample: float, atomic: bool
) -> None:
    """With 40% of GRPO groups rejected, a rollout step keeps issuing (bounded) until its train
    batch can fill, so the replay runs without oversampling and guarded policies meet every
    quota (issue 25: it stalled unless every single step could feed the quotas alone)."""
    settings = ReplaySettings(
        train_batch_size=96,
        quota_ratios={"A": 0.3, "B": 0.3, "C": 0.3},
        oversample=oversample,
        rollout_slots=96,
        group_atomic=atomic,
        train_batches=10,
        warmup=3,
    )
    summary = run_replay(rejecting_trace(0.4), settings, ("barrier", "knittrans", "adaptive"))
    for name, entry in summary["policies"].items():
        assert entry["violations"] == 0, name
        assert entry["steps"] == 7


def test_a_stall_names_the_source_that_ran_short() -> None:
    """When a source's groups are all rejected, the replay stops with an error that names the
    quota that ran short and how many of its trajectories were rejected."""
    settings = ReplaySettings(
        train_batch_size=96,
        quota_ratios={"A": 0.3, "B": 0.3, "C": 0.3},
        rollout_slots=96,
        train_batches=6,
        warmup=2,
    )
    trace = rejecting_trace(0.0, per_source={"B": 1.0})
    with pytest.raises(RuntimeError, match=r"quota 'B' ran short by \d+ trajectories \(\d+ of its"):
        run_replay(trace, settings, ("knittrans",))
