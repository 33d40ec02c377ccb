"""``knitkit.encoder_dedup.testing``: the report's verdicts, and the plain-PyTorch check passing and failing."""

from __future__ import annotations

import json
import math

import pytest
import torch
from dist import World

from encoder_dedup.harness import _groups, _reduce, assignments_for
from encoder_dedup.test_dedup import CASES, MIXED
from encoder_dedup.toy import Layout, ToyBackbone, ToyEncoder, grpo_case, item_view, unit_inputs
from knitkit.encoder_dedup import (
    Comparison,
    EquivalenceError,
    EquivalenceReport,
    LocalTransport,
    ProcessGroupTransport,
    Tolerance,
    check_dedup_equivalence,
)

TOL = Tolerance(rtol=1e-4, floor=1e-6)


def test_comparison_compares_relatively_only_above_the_floor() -> None:
    """Above the floor the relative error decides; below it the row is reported (not passed) and
    fails only beyond ``rtol * floor``; missing shapes and NaN fail; ``None`` is a zero gradient."""
    ref = torch.tensor([1.0, -2.0])
    assert Comparison.of("a", ref * (1 + 5e-5), ref, 0, TOL).status == "ok"
    assert Comparison.of("a", ref * (1 + 5e-4), ref, 0, TOL).status == "mismatch"
    tiny = torch.tensor([1e-9])
    assert Comparison.of("b", tiny * 1.05, tiny, 0, TOL).status == "below_floor"
    assert Comparison.of("b", tiny + 1e-9, tiny, 0, TOL).status == "mismatch"  # > rtol * floor
    assert Comparison.of("c", torch.zeros(3), ref, 0, TOL).status == "missing"
    assert Comparison.of("d", torch.tensor([math.nan, 0.0]), ref, 0, TOL).status == "mismatch"
    assert (
        Comparison.of("e", None, ref, 0, TOL).status == "mismatch"
    )  # no gradient where one is due
    assert Comparison.of("f", None, None, 0, TOL).status == "below_floor"
    row = Comparison.of("a", ref * (1 + 5e-5), ref, 3, TOL)
    assert row.relative_error == pytest.approx(5e-5, rel=1e-2) and row.rank == 3


def test_report_merges_ranks_and_names_what_fails() -> None:
    """Merged per name, the worst rank wins (a failure anywhere, else the largest relative error);
    ``raise_if_failed`` names the failing parameters and states unexpected below-floor ones."""
    ref = torch.ones(2)
    rank0 = EquivalenceReport(
        "t",
        TOL,
        (Comparison.of("encoder.w", ref, ref, 0, TOL), Comparison.of("b", ref, ref, 0, TOL)),
    )
    rank1 = EquivalenceReport(
        "t",
        TOL,
        (Comparison.of("encoder.w", ref * 1.01, ref, 1, TOL), Comparison.of("b", ref, ref, 1, TOL)),
    )
    merged = EquivalenceReport.merged([rank0, rank1])
    assert [(c.name, c.rank, c.status) for c in merged.gradients] == [
        ("encoder.w", 1, "mismatch"),
        ("b", 0, "ok"),
    ]
    assert not merged.ok
    with pytest.raises(EquivalenceError, match=r"failing \(1\): encoder\.w"):
        merged.raise_if_failed()
    assert "encoder.w" in merged.table() and "FAIL" in merged.table()
    data = json.loads(json.dumps(merged.to_json()))
    assert data["ok"] is False and data["gradients"][0]["relative_error"] == pytest.approx(0.01)

    fine = EquivalenceReport.merged([rank0])
    fine.raise_if_failed(expect_below_floor=())
    with pytest.raises(EquivalenceError, match="stated"):
        fine.raise_if_failed(expect_below_floor=("b",))


def test_report_with_most_encoder_gradients_below_the_floor_fails() -> None:
    """One live projector over a detached trunk proves nothing about the trunk: a vision path
    with more than half its parameters below the floor fails, naming them; half may be."""
    one, zero = torch.ones(2), torch.zeros(2)
    rows = [Comparison.of("encoder.projector", one, one, 0, TOL)]
    rows += [Comparison.of(f"encoder.trunk{i}", zero, zero, 0, TOL) for i in range(3)]
    rows.append(Comparison.of("lm.w", one, one, 0, TOL))
    trunk = EquivalenceReport("t", TOL, tuple(rows), units_with_dedup=1, expected_units=1)
    assert trunk.failures == () and not trunk.ok
    assert "3 of 4 encoder parameters" in trunk.problems[0]
    assert "encoder.trunk0, encoder.trunk1, encoder.trunk2" in trunk.problems[0]
    half = EquivalenceReport("t", TOL, (*rows[:2], rows[4]), units_with_dedup=1, expected_units=1)
    assert half.ok, half.problems


def test_report_without_an_encoder_gradient_above_the_floor_fails() -> None:
    """A check whose encoder parameters all have ~zero reference gradients proves nothing: it fails."""
    zero = torch.zeros(2)
    report = EquivalenceReport(
        "t",
        TOL,
        (Comparison.of("encoder.w", zero, zero, 0, TOL),),
        units_with_dedup=2,
        expected_units=2,
    )
    assert report.failures == () and not report.ok
    assert "1 of 1 encoder parameters" in report.problems[0]
    counted = EquivalenceReport(
        "t",
        TOL,
        (Comparison.of("encoder.w", torch.ones(1), torch.ones(1), 0, TOL),),
        units_with_dedup=3,
        expected_units=2,
    )
    assert counted.problems == ("dedup encoded 3 units, expected 2",)


def test_plain_check_passes_on_the_toy_vlm() -> None:
    """One process: every encoder and backbone gradient above the floor and within fp32 tolerance;
    each unique unit encoded once, the baseline re-encoding every consumed piece."""
    case = CASES["several_images_video_text_only"]
    torch.manual_seed(0)
    encoder, backbone = ToyEncoder(), ToyBackbone(False, 1)
    units = unit_inputs(case)
    views = [[item_view(case, p, 0) for p in mb] for mb in case.micro_batches[0]]
    norm = float(sum(t.length for t in case.trajectories))
    report = check_dedup_equivalence(
        encoder,
        backbone,
        encode_fn=lambda keys: encoder([units[k] for k in keys]),
        backbone_step=lambda i, feats: backbone(views[i], feats, None, norm),
        assignment=assignments_for(case),
        hidden=16,
        transport=LocalTransport(),
    )
    print(report.table())
    report.raise_if_failed(expect_below_floor=())
    assert report.worst_relative_error <= report.tolerance.rtol == 1e-4
    unique = len({ref.key for t in case.trajectories for ref in t.refs})
    assert report.units_with_dedup == report.expected_units == unique
    assert report.units_without_dedup > unique


def _dp2_without_encoder_sync(rank: int) -> EquivalenceReport:
    """DP=2 where the trainer forgets ``sync_encoder_grads``: only the encoding rank has encoder grads."""
    case = grpo_case("dp2", Layout(dp=2), MIXED, n=4)
    dp_group, _, own = _groups(rank, case)
    try:
        torch.manual_seed(0)
        encoder, backbone = ToyEncoder(), ToyBackbone(False, 1)
        units = unit_inputs(case)
        views = [[item_view(case, p, 0) for p in mb] for mb in case.micro_batches[rank]]
        norm = float(sum(t.length for t in case.trajectories))
        return check_dedup_equivalence(
            encoder,
            backbone,
            encode_fn=lambda keys: encoder([units[k] for k in keys]),
            backbone_step=lambda i, feats: backbone(views[i], feats, None, norm),
            assignment=assignments_for(case),
            hidden=16,
            transport=ProcessGroupTransport(),
            reduce_dedup=lambda: _reduce(backbone.parameters(), dp_group),  # encoder sync missing
        )
    finally:
        for group in own:
            torch.distributed.destroy_process_group(group)


def test_plain_check_fails_naming_encoder_parameters_a_broken_trainer_leaves_unsynced(
    world2: World,
) -> None:
    """A dedup step whose encoder gradients are never summed over ranks fails the check on every
    encoder parameter, by name; the backbone still matches."""
    reports = world2.run(_dp2_without_encoder_sync)
    report = reports[0]
    assert reports[1] == report, "every rank holds the merged report"
    failing = {c.name for c in report.failures}
    assert failing == {n for n in (c.name for c in report.gradients) if n.startswith("encoder.")}
    with pytest.raises(EquivalenceError, match=r"encoder\.patch\.weight"):
        report.raise_if_failed()
