"""The admission controller: readiness, guards, irrevocable admission, rollover, counters."""

from __future__ import annotations

import dataclasses

import pytest

from knitkit.admission import (
    AdmissionConfig,
    AdmissionController,
    CandidateRequest,
    CompletionQuota,
    ExplicitSchedule,
    SourceQuota,
    build_controller,
)
from knitkit.admission.pool import ReadyPool
from knitkit.types import TrajectoryMeta


def meta(
    i: int, source: str, *, sample: str | None = None, version: int = 0, accepted: bool = True
) -> TrajectoryMeta:
    return TrajectoryMeta(f"t{i}", sample or f"s{i}", source, 0, 10, version, version, accepted)


def two_source(policy: str, **kw: object) -> AdmissionController:
    """The paper's example: 100 trajectories, 50 from each of A and B, four mini-batches of 25."""
    quotas = [SourceQuota(source="A", min_count=50), SourceQuota(source="B", min_count=50)]
    return build_controller(
        policy, train_batch_size=100, num_minibatches=4, sources=["A", "B"], quotas=quotas, **kw
    )


def drain(ctl: AdmissionController) -> list:
    out = []
    while (mb := ctl.next_minibatch()) is not None:
        out.append(mb)
    return out


def test_guard_blocks_the_papers_infeasible_composition() -> None:
    """With A completing first, the guard never lets A take more than 50 slots (eq. 4)."""
    ctl = two_source("knittrans")
    admitted = []
    for i in range(90):
        ctl.report(meta(i, "A"))
        admitted += drain(ctl)
    assert sum(len(mb.trajectories) for mb in admitted) == 50  # two mini-batches of A only
    for i in range(90, 140):
        ctl.report(meta(i, "B"))
        admitted += drain(ctl)
    first = [mb for mb in admitted if mb.train_batch == 0]
    counts = {s: sum(t.source == s for mb in first for t in mb.trajectories) for s in "AB"}
    assert len(first) == 4 and counts == {"A": 50, "B": 50}


def test_noguard_violates_where_knittrans_does_not() -> None:
    """Progressive targets without guards let the fast source over-fill early mini-batches."""
    ctl = two_source("noguard", source_schedule=ExplicitSchedule.of((0.2, 0.2, 0.2, 1.0)))
    for i in range(10):
        ctl.report(meta(1000 + i, "B"))
    admitted = []
    for i in range(80):
        ctl.report(meta(i, "A"))
        admitted += drain(ctl)
    for i in range(60):
        ctl.report(meta(2000 + i, "B"))
        admitted += drain(ctl)
    batch = [t for mb in admitted if mb.train_batch == 0 for t in mb.trajectories]
    assert len(batch) == 100 and sum(t.source == "B" for t in batch) < 50


def test_barrier_admits_nothing_until_the_whole_batch_is_ready() -> None:
    """Train-batch admission: all n mini-batches are admitted at the same report."""
    ctl = two_source("barrier")
    times = []
    for i in range(200):
        ctl.report(meta(i, "A" if i % 3 else "B"))
        times += [i] * len(drain(ctl))
        if len(times) >= 4:
            break
    assert len(set(times[:4])) == 1 and times[0] >= 99


def test_streaming_ignores_quotas_and_linear_respects_them() -> None:
    """Streaming admits the first 25 completions; linear waits for both sources' targets."""
    stream, linear = two_source("streaming"), two_source("linear")
    for i in range(25):
        stream.report(meta(i, "A"))
        linear.report(meta(i, "A"))
    assert stream.next_minibatch() is not None and linear.next_minibatch() is None
    for i in range(25, 37):
        linear.report(meta(i, "B"))
    assert linear.next_minibatch() is None  # 12 B < ceil(50 / 4)
    linear.report(meta(37, "B"))
    assert linear.next_minibatch() is not None


def test_rollover_and_irrevocable_admission() -> None:
    """After n mini-batches the next train batch opens; admitted ids never reappear."""
    ctl = two_source("knittrans")
    seen: set[str] = set()
    batches = set()
    for i in range(1000):
        ctl.report(meta(i, "AB"[i % 2]))
        for mb in drain(ctl):
            ids = {t.trajectory_id for t in mb.trajectories}
            assert not ids & seen
            seen |= ids
            batches.add(mb.train_batch)
    assert batches == set(range(10)) and ctl.stats.admitted == 1000 and ctl.pending == 0


def test_bad_reports_leave_state_unchanged() -> None:
    """Unknown source, duplicate id and negative counts raise a clear error and change nothing."""
    ctl = two_source("knittrans")
    ctl.report(meta(1, "A"))
    before = (dataclasses.astuple(ctl.stats), ctl.ready_counts(), ctl.pending)
    with pytest.raises(ValueError, match="unknown source 'Z'"):
        ctl.report(meta(2, "Z"))
    with pytest.raises(ValueError, match="'t1' was already reported"):
        ctl.report(meta(1, "A"))
    bad = TrajectoryMeta("t9", "s9", "A", -1, 10, 0, 0)
    with pytest.raises(ValueError, match="rollout_step=-1"):
        ctl.report(bad)
    with pytest.raises(ValueError, match="count=-3"):
        ctl.issued(0, -3)
    with pytest.raises(ValueError, match="num_tokens=-1"):
        TrajectoryMeta("t8", "s8", "A", 0, -1, 0, 0)
    assert (dataclasses.astuple(ctl.stats), ctl.ready_counts(), ctl.pending) == before
    ctl.report(meta(9, "A"))  # the rejected id t9 was not consumed
    assert ctl.ready_counts()["A"] == 2


@pytest.mark.parametrize(
    ("quotas", "message"),
    [
        (
            [SourceQuota(source="A", min_ratio=0.6), SourceQuota(source="B", min_ratio=0.5)],
            "jointly unsatisfiable",
        ),
        (
            [SourceQuota(source="A", max_ratio=0.3), SourceQuota(source="B", max_count=20)],
            "every source is upper-bounded",
        ),
        ([SourceQuota(source="C", min_count=1)], "unknown source 'C'"),
        (
            [SourceQuota(source="A", min_count=5), SourceQuota(source="A", max_count=9)],
            "two quotas",
        ),
    ],
)
def test_infeasible_configs_fail_at_construction(quotas: list[SourceQuota], message: str) -> None:
    """Jointly unsatisfiable or inconsistent quotas are refused when the controller is built."""
    with pytest.raises(ValueError, match=message):
        build_controller(
            "knittrans",
            train_batch_size=100,
            num_minibatches=4,
            sources=["A", "B"],
            quotas=quotas,
            group_size=4,
        )


def test_negative_or_inverted_bounds_fail() -> None:
    """Negative counts and upper < lower are refused with the source named."""
    with pytest.raises(ValueError, match="'A': min_count=-1"):
        SourceQuota(source="A", min_count=-1)
    with pytest.raises(ValueError, match="upper bound 10 < lower bound 30"):
        SourceQuota(source="A", min_count=30, max_count=10).bounds(100)


def test_unreachable_targets_and_bad_schedules_fail() -> None:
    """A rollout budget below the first readiness target, or a non-monotone schedule, is refused."""
    with pytest.raises(ValueError, match="can never be met"):
        two_source("barrier", rollout_budget={"A": 40, "B": 80})
    with pytest.raises(ValueError, match="must not decrease"):
        two_source("knittrans", source_schedule=ExplicitSchedule.of((0.5, 0.2, 0.7, 1.0)))
    two_source("knittrans", rollout_budget={"A": 40, "B": 80})  # relaxed targets start at 0


def test_upper_bound_is_never_exceeded() -> None:
    """A source with an upper bound contributes at most that many trajectories per train batch."""
    quotas = [SourceQuota(source="A", max_count=30), SourceQuota(source="B", min_count=20)]
    ctl = build_controller(
        "knittrans", train_batch_size=100, num_minibatches=4, sources=["A", "B"], quotas=quotas
    )
    admitted = []
    for i in range(400):
        ctl.report(meta(i, "A" if i % 5 else "B"))
        admitted += drain(ctl)
    for k in {mb.train_batch for mb in admitted}:
        batch = [t for mb in admitted if mb.train_batch == k for t in mb.trajectories]
        if len(batch) == 100:
            assert sum(t.source == "A" for t in batch) <= 30


def test_staleness_bound_and_rejections_are_counted() -> None:
    """Stale and rejected trajectories are counted, never admitted, never lost."""
    ctl = two_source("streaming", max_staleness=1, initial_version=5)
    ctl.report(meta(1, "A", version=3))  # staleness 2 > 1
    ctl.report(meta(2, "A", version=4))
    ctl.report(meta(3, "A", accepted=False))
    assert (ctl.stats.stale_dropped, ctl.stats.rejected, ctl.pending) == (1, 1, 1)
    assert ctl.discard_pending() == 1 and ctl.pending == 0
    stats = ctl.stats
    assert (
        stats.reported
        == 3
        == stats.stale_dropped + stats.rejected + stats.discarded + stats.admitted
    )


def test_grpo_groups_are_admitted_atomically() -> None:
    """With group_size=4 a sample's trajectories are admitted together or not at all."""
    ctl = build_controller(
        "streaming", train_batch_size=100, num_minibatches=4, sources=["A"], group_size=4
    )
    for g in range(7):
        for r in range(3):
            ctl.report(meta(10 * g + r, "A", sample=f"g{g}"))
    assert ctl.next_minibatch() is None  # no group complete
    for g in range(7):
        ctl.report(meta(10 * g + 3, "A", sample=f"g{g}"))
    mb = ctl.next_minibatch()  # mini-batch sizes are 7, 6, 6, 6 groups
    assert mb is not None and len(mb.trajectories) == 28
    samples = {t.sample_id for t in mb.trajectories}
    assert samples == {f"g{g}" for g in range(7)}


def test_completion_quota_gates_admission() -> None:
    """A partial-rollout completion quota delays admission until enough of the step completed."""
    config = AdmissionConfig(
        train_batch_size=8,
        num_minibatches=2,
        sources=("A",),
        predicates=(CompletionQuota(0.5),),
    )
    ctl = AdmissionController(config)
    ctl.issued(0, 20)  # final target: half of 20 completed; first mini-batch: half of that
    for i in range(4):
        ctl.report(meta(i, "A"))
    assert ctl.next_minibatch() is None  # 4 < 0.5 * 10
    ctl.report(meta(4, "A"))
    assert ctl.next_minibatch() is not None
    for i in range(5, 9):
        ctl.report(meta(i, "A"))
    assert ctl.next_minibatch() is None  # 9 < 10, though 5 trajectories are ready
    ctl.report(meta(9, "A"))
    assert ctl.next_minibatch() is not None


class _GreedyA:
    """A user selection policy that ignores the guards: always proposes only source A."""

    def propose(self, request: CandidateRequest, pool: ReadyPool) -> dict[str, int] | None:
        return {"A": min(pool.units("A"), request.size)}


def test_guard_rejects_a_user_selection_that_breaks_feasibility() -> None:
    """The guard (eq. 4) is checked on every proposal, whatever the selection policy does."""
    ctl = two_source("knittrans", selection=_GreedyA())
    for i in range(80):
        ctl.report(meta(i, "A"))
    for i in range(40):
        ctl.report(meta(100 + i, "B"))
    first, second = ctl.next_minibatch(), ctl.next_minibatch()
    assert first is not None and second is not None  # 50 A still fits the A quota exactly
    ready = ctl.ready_counts()
    assert ctl.next_minibatch() is None  # a third all-A mini-batch would leave B unreachable
    assert ctl.ready_counts() == ready and ctl.stats.admitted == 50


def test_completion_quota_of_a_step_issued_mid_batch_does_not_deadlock() -> None:
    """A completion quota's progress is measured against the step it belongs to: a step issued
    while a train batch is open starts from its own progress (0), not the previous step's."""
    ctl = build_controller(
        "knittrans",
        train_batch_size=8,
        num_minibatches=4,
        sources=["A"],
        predicates=(CompletionQuota(0.6),),
    )
    ctl.issued(0, 100)
    for i in range(100):
        ctl.report(meta(i, "A"))
    assert len(drain(ctl)) == 50  # 12 train batches plus two mini-batches of the 13th
    ctl.issued(1, 10)
    for i in range(100, 110):
        ctl.report(dataclasses.replace(meta(i, "A"), rollout_step=1))
    admitted = [(mb.train_batch, mb.index) for mb in drain(ctl)]
    assert admitted == [(12, 2), (12, 3), (13, 0), (13, 1), (13, 2)]  # all 10 of step 1


def test_max_staleness_expires_exactly_the_stale_units_at_each_boundary() -> None:
    """When a train batch opens, exactly the pending units older than the bound leave the pool
    (counted), wherever they sit in their source's queue; fresher ones stay, in order."""
    ctl = build_controller(
        "knittrans",
        train_batch_size=2,
        num_minibatches=1,
        sources=["A", "B"],
        quotas=[SourceQuota(source="B", min_count=1)],
        max_staleness=1,
    )
    for i, version in enumerate([0, 1, 0, 1, 0]):
        ctl.report(meta(i, "A", version=version))
    ids = []
    for b in range(3):
        ctl.report(meta(100 + b, "B", version=b))
        mb = ctl.next_minibatch()
        assert mb is not None
        ids.append([t.trajectory_id for t in mb.trajectories])
        assert ctl.stats.stale_dropped == (0 if b == 0 else 2)
    assert ids == [["t0", "t100"], ["t1", "t101"], ["t3", "t102"]]
    assert ctl.ready_counts() == {"A": 0, "B": 0} and ctl.pending == 0
