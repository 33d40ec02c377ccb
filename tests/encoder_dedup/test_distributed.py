"""Gradient equivalence on real multi-process worlds (gloo on CPU, NCCL on GPUs) for every parallel layout.

Each case runs the re-encoding baseline and knitkit's dedup on every rank of a spawned world and
compares every encoder, projector and backbone gradient after the trainer's reductions (DP x CP
all-reduce for the baseline and the backbone; ``sync_encoder_grads`` for the deduplicated encoder).
Two worlds (2 and 4 ranks, ``conftest.py``) are spawned once and reused by all cases.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist import World

from encoder_dedup.harness import run_case
from encoder_dedup.test_dedup import BF16_RTOL, FP32_RTOL, MIXED, assert_equivalent
from encoder_dedup.toy import Case, Layout, grpo_case

ACROSS_CP = [[("image", 8)], [("image", 3), ("video", 4)], []]
"""With length 24 and CP=2 the chunk boundary is at 6: the 8-row image at [2, 10) crosses it."""

CASES_2 = {
    "dp2": grpo_case("dp2", Layout(dp=2), MIXED, n=4),
    "tp2_megatron_replicated_inputs": grpo_case("tp2", Layout(tp=2, megatron=True), MIXED, n=4),
    "cp2_image_across_boundary": grpo_case("cp2", Layout(cp=2), ACROSS_CP, n=4),
    "encoder_dp1_backbone_dp2": grpo_case("edp1", Layout(dp=2, encoder_ranks=(1,)), MIXED, n=4),
    "dp2_bf16": grpo_case("bf16", Layout(dp=2), MIXED, n=4, dtype="bfloat16"),
}
CASES_4 = {
    "dp2_tp2_megatron_encoder_dp4": grpo_case(
        "dp2tp2", Layout(dp=2, tp=2, megatron=True), MIXED, n=4
    ),
    "dp2_tp2_encoder_dp2_other_ranks": grpo_case(
        "dp2tp2e", Layout(dp=2, tp=2, encoder_ranks=(0, 3)), MIXED, n=4
    ),
    "tp2_cp2_megatron": grpo_case("tp2cp2", Layout(tp=2, cp=2, megatron=True), ACROSS_CP, n=4),
    "dp2_cp2_encoder_dp1": grpo_case(
        "dp2cp2", Layout(dp=2, cp=2, encoder_ranks=(2,)), ACROSS_CP, n=2
    ),
}


def _check(case: Case, results: list) -> None:
    for rank, (report, _, _) in enumerate(results):
        try:
            assert_equivalent(report, BF16_RTOL if case.dtype == "bfloat16" else FP32_RTOL)
        except AssertionError as err:
            raise AssertionError(f"{case.name}, rank {rank}: {err}") from None
    unique = len({ref.key for t in case.trajectories for ref in t.refs})
    assert sum(r[2] for r in results) == unique, "every unique unit is encoded exactly once"
    assert sum(r[1] for r in results) > unique


@pytest.mark.parametrize("name", list(CASES_2))
def test_two_rank_layouts_match_baseline(world2: World, name: str) -> None:
    """DP=2, TP=2 (megatron-core layers), CP=2 across an image, encoder DP != backbone DP, bf16."""
    case = CASES_2[name]
    _check(case, world2.run(run_case, case))


@pytest.mark.parametrize("name", list(CASES_4))
def test_four_rank_layouts_match_baseline(world4: World, name: str) -> None:
    """DP=2 x TP=2 (megatron-core), TP=2 x CP=2, DP=2 x CP=2, with encoder DPs of 1, 2 and 4."""
    case = CASES_4[name]
    _check(case, world4.run(run_case, case))


def test_summing_tp_replicas_would_double_encoder_gradients(world4: World) -> None:
    """Negative control: if every TP replica returned its full gradient, encoder grads come out x2."""
    case = dataclasses.replace(CASES_4["dp2_tp2_megatron_encoder_dp4"], declare_tp_groups=False)
    for report, _, _ in world4.run(run_case, case):
        for name, (diff, norm) in report.items():
            if name.startswith("encoder."):
                assert diff == pytest.approx(norm, rel=1e-4), name
            else:
                assert diff <= FP32_RTOL * norm + 1e-7, name


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs CUDA: 2 GPUs for a 2-rank NCCL world")
@pytest.mark.parametrize(
    "name", ["dp2", "cp2_image_across_boundary", "tp2_megatron_replicated_inputs"]
)
def test_nccl_two_rank_layouts_match_baseline(name: str) -> None:
    """The same equivalence with CUDA tensors and NCCL all-to-all."""
    case = dataclasses.replace(CASES_2[name], device="cuda")
    with World(2, backend="nccl", timeout_s=300) as world:
        _check(case, world.run(run_case, case))


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_devices() < 4, reason="needs CUDA: 4 GPUs for a 4-rank NCCL world")
def test_nccl_dp2_tp2_matches_baseline() -> None:
    """DP=2 x TP=2 with megatron-core layers on CUDA/NCCL."""
    case = dataclasses.replace(CASES_4["dp2_tp2_megatron_encoder_dp4"], device="cuda")
    with World(4, backend="nccl", timeout_s=300) as world:
        _check(case, world.run(run_case, case))
