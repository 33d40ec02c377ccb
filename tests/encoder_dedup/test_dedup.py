"""DedupEncoder in one process: gradients equal the re-encoding baseline; each unique unit is encoded once."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from encoder_dedup.harness import plan_for, run_case
from encoder_dedup.toy import Case, Layout, Piece, ToyEncoder, grpo_case, unit_inputs
from knitkit.encoder_dedup import (
    BackboneAssignment,
    DedupEncoder,
    EncoderAssignment,
    LocalTransport,
    RowSlice,
    build_routing_plan,
)
from knitkit.types import UnitKey

FP32_RTOL = 1e-5
"""fp32: dedup only reorders sums (per-row gradient accumulation), so norms agree to ~1e-7."""
BF16_RTOL = 3e-2
"""bf16: the baseline accumulates parameter gradients per micro-batch in bf16; dedup sums in fp32."""

MIXED = [[("image", 5)], [("image", 3), ("image", 2), ("video", 4), ("video", 4)], []]
"""One image; several images plus two video frame groups; a text-only sample."""


def _straddling() -> Case:
    """Trajectory 0 is cut at position 8, inside its 8-row image: the image spans two micro-batches."""
    case = grpo_case("straddle", Layout(), [[("image", 8)]], n=3)
    micro = ((Piece(0, 0, 8), Piece(1, 0, 24)), (Piece(0, 8, 24), Piece(2, 0, 24)))
    return dataclasses.replace(case, micro_batches=(micro,))


CASES = {
    "several_images_video_text_only": grpo_case("mixed", Layout(), MIXED, n=4, micro_size=3),
    "straddle_two_micro_batches": _straddling(),
    "n1_nothing_to_dedup": grpo_case("n1", Layout(), MIXED, n=1),
    "bf16": grpo_case("bf16", Layout(), MIXED, n=4, dtype="bfloat16"),
}


def assert_equivalent(report: dict[str, tuple[float, float]], rtol: float) -> None:
    """Every encoder, projector and backbone gradient matches the baseline within ``rtol`` (by norm)."""
    assert any(k.startswith("encoder.projector") for k in report)
    for name, (diff, norm) in report.items():
        assert norm > 0, f"{name}: baseline gradient is zero, the case does not exercise it"
        assert diff <= rtol * norm + 1e-7, (
            f"{name}: |dedup - baseline| = {diff:.3g}, |baseline| = {norm:.3g}"
        )


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_reencoding_baseline(name: str) -> None:
    """One process: each unique unit encoded once; all gradients equal the per-micro-batch baseline."""
    case = CASES[name]
    report, baseline_encodes, dedup_encodes = run_case(0, case)
    assert_equivalent(report, BF16_RTOL if case.dtype == "bfloat16" else FP32_RTOL)
    unique = len({ref.key for t in case.trajectories for ref in t.refs})
    assert dedup_encodes == unique
    assert baseline_encodes > unique or name.startswith("n1")


def _encoder_and_dedup(case: Case) -> tuple[ToyEncoder, DedupEncoder, dict]:
    encoder = ToyEncoder()
    dedup = DedupEncoder(plan_for(case).for_rank(0), LocalTransport(), hidden=16)
    return encoder, dedup, unit_inputs(case)


def test_micro_batch_copies_are_released_after_backward() -> None:
    """A finished micro-batch leaves nothing behind: its feature leaf and leaf grad are freed."""
    case = CASES["several_images_video_text_only"]
    encoder, dedup, units = _encoder_and_dedup(case)
    dedup.encode(lambda keys: encoder([units[k] for k in keys]))
    refs = []
    for micro in range(len(dedup.route.micro_batch_index)):
        features = dedup.features(micro)
        (features.square().sum()).backward()
        refs.append(weakref.ref(features))
        del features
        gc.collect()
        assert refs[-1]() is None, f"micro-batch {micro}: features still alive after backward"
    assert float(dedup.cache_grad.abs().sum()) > 0
    dedup.backward()
    assert encoder.patch.weight.grad is not None


def test_calls_out_of_order_say_what_to_do() -> None:
    """features() before encode() and a second backward() are errors that name the expected order."""
    case = CASES["n1_nothing_to_dedup"]
    encoder, dedup, units = _encoder_and_dedup(case)
    with pytest.raises(RuntimeError, match=r"encode\(\) -> features"):
        dedup.features(0)
    dedup.encode(lambda keys: encoder([units[k] for k in keys]))
    dedup.backward()
    with pytest.raises(RuntimeError, match="phase 'done'"):
        dedup.backward()


def test_encoder_output_of_wrong_shape_is_rejected() -> None:
    """An encode_fn that does not return one row per placeholder token is named with its keys."""
    case = CASES["n1_nothing_to_dedup"]
    _, dedup, _ = _encoder_and_dedup(case)
    with pytest.raises(ValueError, match="one row per placeholder token"):
        dedup.encode(lambda keys: torch.zeros(1, 16))


def _one_unit_dedup(
    consumed: list[list[RowSlice]],
) -> tuple[torch.nn.Linear, torch.Tensor, DedupEncoder]:
    """One rank, one 8-row unit encoded by a linear layer, consumed as ``consumed`` says."""
    key = UnitKey("u", "image")
    plan = build_routing_plan(
        EncoderAssignment({0: [[key]]}, {key: 8}), BackboneAssignment({0: consumed}), 1
    )
    encoder = torch.nn.Linear(4, 3)
    pixels = torch.randn(8, 4)
    dedup = DedupEncoder(plan.for_rank(0), LocalTransport(), hidden=3)
    dedup.encode(lambda keys: encoder(pixels))
    return encoder, pixels, dedup


def test_each_piece_gathers_its_own_rows_of_a_unit_consumed_in_disjoint_runs() -> None:
    """A rank consuming rows [0, 2), [5, 8) and [1, 2) of one unit holds two cache runs; every
    micro-batch gets exactly the rows its pieces name, in order (not rows of the unit's first run)."""
    u = UnitKey("u", "image")
    consumed = [[RowSlice(u, 5, 8)], [RowSlice(u, 0, 2), RowSlice(u, 6, 7)], [RowSlice(u, 1, 2)]]
    encoder, pixels, dedup = _one_unit_dedup(consumed)
    rows = encoder(pixels).detach()
    assert dedup.route.cache_rows == 5  # runs [0, 2) and [5, 8)
    for micro, pieces in enumerate(consumed):
        expected = torch.cat([rows[p.start : p.stop] for p in pieces])
        torch.testing.assert_close(dedup.features(micro), expected, rtol=0, atol=0)


def test_backward_scale_multiplies_the_encoder_gradients() -> None:
    """``backward(scale=s)``: every encoder gradient is ``s`` times the one of ``scale=1``."""
    u = UnitKey("u", "image")
    grads = []
    for scale in (1.0, 3.0):
        torch.manual_seed(0)
        encoder, _, dedup = _one_unit_dedup([[RowSlice(u, 0, 8)]])
        dedup.features(0).square().sum().backward()
        dedup.backward(scale=scale)
        assert encoder.weight.grad is not None and float(encoder.weight.grad.abs().max()) > 0
        grads.append(encoder.weight.grad.clone())
    torch.testing.assert_close(grads[1], 3.0 * grads[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_reencoding_baseline_on_cuda(name: str) -> None:
    """The one-process equivalence with every tensor on the GPU."""
    case = dataclasses.replace(CASES[name], device="cuda")
    report, _, dedup_encodes = run_case(0, case)
    assert_equivalent(report, BF16_RTOL if case.dtype == "bfloat16" else FP32_RTOL)
    assert dedup_encodes == len({ref.key for t in case.trajectories for ref in t.refs})
