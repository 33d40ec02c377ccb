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


def snapshot(ctl: AdmissionController) -> tuple:
    """What a caller can observe of a controller: counters, ready counts, pending, train batch."""
    return dataclasses.astuple(ctl.stats), ctl.ready_counts(), ctl.pending, ctl.train_batch


def close_batches(ctl: AdmissionController, reports: list[TrajectoryMeta]) -> list:
    """Report each trajectory, then admit whatever is admissible; returns every mini-batch."""
    out = []
    for item in reports:
        ctl.report(item)
        out += drain(ctl)
    return out


@pytest.mark.parametrize("policy", ["barrier", "linear", "knittrans", "adaptive"])
def test_quotas_in_separate_groups_keep_the_whole_batch_feasible(policy: str) -> None:
    """Source quotas labelled with different groups still compete for the same slots: the
    guard is joint, so no mini-batch leaves the open train batch unable to meet every quota
    (issue 25's deadlock: two all-c mini-batches left 4 slots for a and b needing 4 each)."""
    quotas = [
        SourceQuota(source="a", min_ratio=0.5, group="g1"),
        SourceQuota(source="b", min_ratio=0.5, group="g2"),
    ]
    ctl = build_controller(
        policy, train_batch_size=8, num_minibatches=4, sources=["a", "b", "c"], quotas=quotas
    )
    reports = [meta(100 * k + i, s) for k, s in enumerate("cab") for i in range(8)]
    admitted = []
    for chunk in range(3):  # next_minibatch() after each source's 8 reports, as in the issue
        for item in reports[8 * chunk : 8 * chunk + 8]:
            ctl.report(item)
        admitted += drain(ctl)
    first = [t.source for mb in admitted if mb.train_batch == 0 for t in mb.trajectories]
    assert sorted(first) == ["a"] * 4 + ["b"] * 4


def test_grpo_groups_of_different_sources_with_one_sample_id_stay_apart() -> None:
    """A GRPO group is keyed by (source, sample_id): datasets number prompts independently, so
    ("math", "17") and ("code", "17") are two groups, and quotas count each correctly (issue 25:
    they merged and train batch 0 closed as {math: 2, code: 6})."""
    ctl = build_controller(
        "knittrans",
        train_batch_size=8,
        num_minibatches=2,
        sources=["math", "code"],
        quotas=[SourceQuota(source="math", min_count=4), SourceQuota(source="code", min_count=4)],
        group_size=2,
    )
    order = [("math", "17"), ("code", "17"), ("math", "18"), ("code", "18")]
    order += [("code", "5"), ("code", "5"), ("code", "6"), ("code", "6")]
    reports = [meta(i, s, sample=p) for i, (s, p) in enumerate(order)]
    admitted = close_batches(ctl, reports)
    assert all(mb.train_batch > 0 or mb.index < 1 for mb in admitted)  # batch 0 stays open
    admitted += close_batches(
        ctl, [meta(20 + i, s, sample=p) for i, (s, p) in enumerate(order[:4])]
    )
    batch0 = [t for mb in admitted if mb.train_batch == 0 for t in mb.trajectories]
    assert len(batch0) == 8
    assert sum(t.source == "math" for t in batch0) == 4
    groups = {(t.source, t.sample_id) for t in batch0}
    assert all(sum((t.source, t.sample_id) == g for t in batch0) == 2 for g in groups)


def test_a_group_member_from_another_rollout_step_is_refused_by_name() -> None:
    """Members of one GRPO group share source, sample_id and rollout step; a member that
    disagrees is refused naming the group, and nothing changes."""
    ctl = build_controller(
        "knittrans", train_batch_size=8, num_minibatches=2, sources=["math"], group_size=2
    )
    ctl.report(meta(1, "math", sample="17"))
    before = snapshot(ctl)
    late = dataclasses.replace(meta(2, "math", sample="17"), rollout_step=3)
    with pytest.raises(
        ValueError, match=r"GRPO group \('math', '17'\) was issued in rollout step 0"
    ):
        ctl.report(late)
    assert snapshot(ctl) == before


@pytest.mark.parametrize("policy", ["linear", "knittrans", "adaptive"])
def test_discarding_pending_mid_batch_does_not_keep_discarded_trajectories_in_targets(
    policy: str,
) -> None:
    """After discard_pending() in an open train batch, the readiness targets no longer count
    the discarded trajectories: B=16, a >= 8, 40 a ready at open, one mini-batch admitted,
    discard, then 6 a + 6 b admit its 3 remaining mini-batches (issue 25: 0 of 3)."""
    ctl = build_controller(
        policy,
        train_batch_size=16,
        num_minibatches=4,
        sources=["a", "b"],
        quotas=[SourceQuota(source="a", min_count=8)],
    )
    for i in range(56):  # train batch 0 takes 16; 40 are ready when train batch 1 opens
        ctl.report(meta(i, "a"))
    assert [mb.train_batch for mb in (ctl.next_minibatch() for _ in range(4))] == [0] * 4
    first = ctl.next_minibatch()
    assert first is not None and (first.train_batch, first.index) == (1, 0)
    assert ctl.discard_pending() == 36
    rest = close_batches(
        ctl, [meta(100 + 2 * i + k, s) for i in range(6) for k, s in enumerate("ab")]
    )
    assert [mb.index for mb in rest] == [1, 2, 3]
    batch = [t for mb in (first, *rest) for t in mb.trajectories]
    assert sum(t.source == "a" for t in batch) >= 8


def test_members_of_a_discarded_group_reported_later_are_discarded_on_arrival() -> None:
    """discard_pending() drops an incomplete GRPO group; its members reported afterwards are
    discarded on arrival (``stats.discarded``, ``discarded_late``), never pending, never counted
    as supply by shortfall(); other groups complete as before (issue 30.4: they formed a group
    that could never complete and stayed pending forever)."""
    ctl = build_controller(
        "knittrans", train_batch_size=8, num_minibatches=2, sources=["a"], group_size=4
    )
    for i in range(2):
        ctl.report(meta(i, "a", sample="g0"))
    assert ctl.discard_pending() == 2
    for i in range(2, 4):
        ctl.report(meta(i, "a", sample="g0"))
    assert ctl.pending == 0 and ctl.stats.discarded == 4
    assert ctl.stats.discarded_late == 2
    assert ctl.metrics()["knitkit/admission/discarded_late"] == 2.0
    assert ctl.shortfall().any_source == 8
    with pytest.raises(ValueError, match="'t3' was already reported"):
        ctl.report(meta(3, "a", sample="g0"))
    batches = close_batches(ctl, [meta(10 + i, "a", sample=f"g{1 + i // 4}") for i in range(8)])
    assert [len(mb.trajectories) for mb in batches] == [4, 4]
    assert ctl.pending == 0


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: two_source_on(sources="ab"), "sources='ab': give a list of source names"),
        (lambda: SourceQuota(source="A", min_count=2.5), "quota 'A': min_count=2.5"),
        (lambda: SourceQuota(source="A", max_count=True), "quota 'A': max_count=True"),
        (lambda: SourceQuota(source="A", min_ratio=float("nan")), "quota 'A': min_ratio=nan"),
        (lambda: SourceQuota(source="", min_count=1), "quota source=''"),
        (lambda: two_source_on(max_staleness=1.5), "max_staleness=1.5"),
        (lambda: two_source_on(train_batch_size=100.0), "train_batch_size=100.0"),
        (lambda: two_source_on(group_size=0), "group_size=0"),
        (lambda: two_source_on(rollout_budget={"A": 2.5, "B": 80}), r"rollout_budget\['A'\]=2.5"),
        (lambda: CompletionQuota(float("inf")), "CompletionQuota.min_ratio=inf"),
        (
            lambda: two_source_on(predicates=(object(),)),
            r"predicates\[0\]=<object .*> is not a ReadinessPredicate: it lacks name, schedule",
        ),
        (lambda: two_source_on(selection="oldest"), "selection='oldest' is not a SelectionPolicy"),
        (lambda: two_source_on(size_schedule=(0.5, 1.0)), r"size_schedule=\(0.5, 1.0\) is not a"),
    ],
)
def test_fractional_or_malformed_config_is_refused_by_name(build: object, message: str) -> None:
    """Config values of the wrong kind (a string for the sources, fractional counts and
    bounds, NaN ratios, a predicate, selection or schedule that is none) are refused at
    construction with a ValueError naming the field (issue 30.6: ``predicates=(object(),)``
    raised AttributeError)."""
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def two_source_on(**kw: object) -> AdmissionController:
    sources = kw.pop("sources", ["A", "B"])
    size = kw.pop("train_batch_size", 100)
    return build_controller(
        "knittrans",
        train_batch_size=size,
        num_minibatches=4,
        sources=sources,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_tokens": 10.5}, "num_tokens=10.5: give a whole number"),
        ({"rollout_step": 1.0}, "rollout_step=1.0: give a whole number"),
        ({"min_version": 0.5, "max_version": 1}, "min_version=0.5"),
        ({"accepted": "no"}, "accepted='no': give True or False"),
        ({"sample_id": None}, "sample_id=None: give a string"),
        ({"trajectory_id": ""}, "trajectory_id='': give a non-empty string"),
    ],
)
def test_malformed_reports_are_refused_and_change_nothing(
    change: dict[str, object], message: str
) -> None:
    """A report with a fractional count or step, a non-boolean acceptance or a missing sample
    id is refused naming the field; the controller's state is exactly what it was."""
    ctl = two_source("knittrans", group_size=2)
    ctl.report(meta(1, "A", sample="g"))
    before = snapshot(ctl)
    with pytest.raises(ValueError, match=message):
        ctl.report(dataclasses.replace(meta(2, "A", sample="g"), **change))  # type: ignore[arg-type]
    assert snapshot(ctl) == before


@pytest.mark.parametrize(("step", "count"), [(0, 2.5), (1.0, 3), (-1, 3), (0, True)])
def test_issued_counts_must_be_whole(step: object, count: object) -> None:
    """issued() takes whole, non-negative steps and counts; anything else is refused naming
    the argument and changes nothing: the completion quota still needs 2 of the 4 issued."""
    ctl = build_controller(
        "knittrans",
        train_batch_size=2,
        num_minibatches=1,
        sources=["A"],
        predicates=(CompletionQuota(0.5),),
    )
    ctl.issued(0, 4)
    with pytest.raises(ValueError, match=r"issued\(\): (rollout_step|count)="):
        ctl.issued(step, count)  # type: ignore[arg-type]
    ctl.report(meta(1, "A"))
    ctl.report(meta(2, "A"))
    assert ctl.next_minibatch() is not None


def test_metrics_are_flat_namespaced_floats_of_the_open_train_batch() -> None:
    """metrics() reports pending per source, admitted mini-batches, the open train batch's
    index and per-quota count and target, the last mini-batch's size and staleness."""
    ctl = two_source("knittrans", initial_version=3)
    for i in range(30):
        ctl.report(meta(i, "A", version=1))
    for i in range(5):
        ctl.report(meta(100 + i, "B", version=2))
    assert ctl.next_minibatch() is not None
    figures = ctl.metrics()
    assert all(k.startswith("knitkit/admission/") for k in figures)
    assert all(type(v) is float for v in figures.values())
    p = "knitkit/admission/"
    assert figures[p + "pending"] == 10.0
    assert (figures[p + "pending/A"], figures[p + "pending/B"]) == (5.0, 5.0)
    assert figures[p + "minibatches_admitted"] == 1.0 and figures[p + "train_batch"] == 0.0
    assert figures[p + "quota/A/count"] == 25.0 and figures[p + "quota/A/target"] == 50.0
    assert figures[p + "quota/B/count"] == 0.0 and figures[p + "quota/B/next_target"] == 0.0
    assert figures[p + "last_minibatch/size"] == 25.0
    assert figures[p + "last_minibatch/staleness_mean"] == 2.0  # version 3 - version 1
    assert figures[p + "rollout_version"] == 2.0 and figures[p + "reported"] == 35.0


def test_duplicates_are_refused_while_pending_and_over_the_window() -> None:
    """A retried id is refused while its trajectory is pending (however long) and for the train
    batch it settled in and the next one; after that it is taken as new (NOTE [ Duplicate
    window ]: the controller no longer remembers every id of the run)."""
    ctl = build_controller(
        "knittrans",
        train_batch_size=4,
        num_minibatches=1,
        sources=["A", "B"],
        quotas=[SourceQuota(source="B", max_count=0)],  # B is never admitted: stays pending
    )
    ctl.report(meta(1000, "B"))
    close_batches(ctl, [meta(i, "A") for i in range(40)])
    assert ctl.train_batch == 10 and ctl.pending == 1
    for i in (1000, 36, 39):
        with pytest.raises(ValueError, match=f"'t{i}' was already reported"):
            ctl.report(meta(i, "A"))
    ctl.report(meta(35, "A"))  # settled two train batches ago: outside the window


def test_shortfall_names_what_the_open_train_batch_cannot_get() -> None:
    """shortfall() counts admitted, ready, incomplete-group and in-flight trajectories as if all
    were accepted: per quota'd source what its lower bound still misses (in whole groups), and
    what the batch misses beyond that, never counting an upper-bounded source past its bound."""
    quotas = [
        SourceQuota(source="A", min_count=8),
        SourceQuota(source="B", min_count=4),
        SourceQuota(source="C", max_count=4),
    ]
    ctl = build_controller(
        "knittrans",
        train_batch_size=24,
        num_minibatches=2,
        sources=["A", "B", "C"],
        quotas=quotas,
        group_size=2,
    )
    for i in range(2):
        ctl.report(meta(i, "A", sample="a0"))
    ctl.report(meta(2, "B", sample="b0"))  # an incomplete group counts as pending
    for i in range(10):
        ctl.report(meta(10 + i, "C", sample=f"c{i // 2}"))
    short = ctl.shortfall({"A": 2})
    assert short.per_source == {"A": 4, "B": 3}
    assert short.any_source == 24 - (8 + 4 + 4)  # C counts up to its bound only
    assert not ctl.shortfall({"A": 14, "B": 3})  # 16 A, 4 B, C up to its bound: 24
