"""Quota bounds in whole GRPO groups: shortfall(), the guard and selection agree on them."""

from __future__ import annotations

import random

import pytest

from knitkit.admission import AdmissionController, SourceQuota, build_controller
from knitkit.admission.bounds import GroupBounds
from knitkit.admission.replay import ReplaySettings, run_replay
from knitkit.types import TrajectoryMeta

from .test_simulate import rejecting_trace

CAPPED = [SourceQuota(source="b", max_ratio=0.375), SourceQuota(source="c", max_ratio=0.375)]
"""b and c at most 12 of 32: 8 in whole groups of 8."""


def capped(policy: str) -> AdmissionController:
    return build_controller(
        policy,
        train_batch_size=32,
        num_minibatches=2,
        sources=["a", "b", "c"],
        quotas=CAPPED,
        group_size=8,
    )


def report_group(
    ctl: AdmissionController, source: str, sample: str, *, accepted: bool = True
) -> None:
    for k in range(8):
        ctl.report(TrajectoryMeta(f"{sample}/{k}", sample, source, 0, 10, 0, 0, accepted))


def test_group_bounds_round_lower_up_and_upper_down() -> None:
    """A lower bound is met at the next whole group, an upper bound stops at the last one."""
    bounds = GroupBounds.of(12, 12, 8)
    assert (bounds.lower, bounds.upper) == (16, 8)
    assert (bounds.deficit(8), bounds.room(8), bounds.usable(16)) == (8, 0, 8)
    assert GroupBounds.of(0, None, 8).usable(40) == 40


def test_shortfall_counts_an_upper_bound_in_whole_groups() -> None:
    """Issue 30's minimal case: 16 admitted (b 8, c 8), ready a 8 / b 8 / c 8, b and c <= 12 of
    32. b and c can take no further group, so only a's 8 can join: the batch misses 8, and
    shortfall() says so (it used to cap b and c at 12, call the batch completable, and a
    dynamic-sampling loop waited forever)."""
    ctl = capped("knittrans")
    report_group(ctl, "b", "b0")
    report_group(ctl, "c", "c0")
    assert ctl.next_minibatch() is not None
    for source in "abc":
        report_group(ctl, source, f"{source}1")
    assert ctl.next_minibatch() is None
    short = ctl.shortfall()
    assert short and short.any_source == 8 and short.per_source == {}
    report_group(ctl, "a", "a2")  # what the shortfall asked for completes the batch
    assert ctl.next_minibatch() is not None and ctl.train_batch == 1


@pytest.mark.parametrize("policy", ["barrier", "linear", "knittrans", "adaptive"])
@pytest.mark.parametrize("seed", range(5))
def test_a_dynamic_sampling_loop_that_resamples_on_shortfall_terminates(
    policy: str, seed: int
) -> None:
    """A DAPO-style loop (issue a step's groups, reject some at random, issue exactly what
    shortfall() names, the any-source part spread over every source) closes 6 train batches
    within a bound, for every guarded policy: shortfall() is never empty while no mini-batch
    can be admitted and nothing is in flight (issue 30: 20 of 20 such runs deadlocked)."""
    rng = random.Random(seed)
    ctl = capped(policy)
    flying: list[tuple[str, str]] = []  # groups issued, not yet reported
    serial = 0

    def issue(source: str) -> None:
        nonlocal serial
        flying.append((source, f"g{serial}"))
        serial += 1

    for k in range(5):
        issue("abc"[k % 3])
    turn = 0
    for _ in range(2000):
        if ctl.train_batch == 6:
            return
        if flying:
            source, sample = flying.pop(rng.randrange(len(flying)))
            report_group(ctl, source, sample, accepted=rng.random() > 0.3)
        opened = ctl.train_batch
        while ctl.next_minibatch() is not None:
            pass
        if ctl.train_batch > opened:
            for k in range(5):  # the next rollout step
                issue("abc"[k % 3])
        in_flight = {s: 8 * sum(f[0] == s for f in flying) for s in "abc"}
        short = ctl.shortfall(in_flight)
        if not flying:
            assert short, f"deadlock: nothing in flight, nothing admissible, shortfall {short}"
        for source, missing in short.per_source.items():
            for _ in range(-(-missing // 8)):
                issue(source)
        for _ in range(-(-short.any_source // 8)):
            issue("abc"[turn % 3])
            turn += 1
    pytest.fail(f"{policy}: only {ctl.train_batch} of 6 train batches closed in 2000 events")


def test_the_replay_with_atomic_groups_fills_under_upper_bounds() -> None:
    """The replay with atomic groups of 8, 30% of groups rejected and b, c capped below a whole
    multiple of the group (12 of 32) fills every train batch: its dynamic sampling asks
    shortfall(), which counts the caps in whole groups (it used to stall, blaming
    oversampling)."""
    settings = ReplaySettings(
        train_batch_size=32,
        num_minibatches=2,
        quota_specs=(
            SourceQuota(source="B", max_ratio=0.375),
            SourceQuota(source="C", max_ratio=0.375),
        ),
        oversample=0.0,
        rollout_slots=32,
        group_atomic=True,
        train_batches=8,
        warmup=2,
    )
    summary = run_replay(rejecting_trace(0.3), settings, ("barrier", "knittrans", "adaptive"))
    for name, entry in summary["policies"].items():
        assert entry["steps"] == 6, name
