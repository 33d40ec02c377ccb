"""Edges of the dedup core: plan validation and gradient precision (issue 10, failures 5 and 6)."""

from __future__ import annotations

import pytest
import torch

from knitkit.encoder_dedup import (
    BackboneAssignment,
    DedupEncoder,
    EncoderAssignment,
    LocalTransport,
    RowSlice,
    build_routing_plan,
    sync_encoder_grads,
)
from knitkit.types import UnitKey

A = UnitKey("a", "image")


def _assignments(
    consumers: dict[int, list[list[RowSlice]]], tp_groups: tuple[tuple[int, ...], ...] = ()
) -> tuple[EncoderAssignment, BackboneAssignment]:
    return EncoderAssignment({0: [[A]]}, {A: 4}), BackboneAssignment(consumers, tp_groups)


def test_consumer_rank_outside_the_world_is_an_error() -> None:
    """A consumer rank >= world_size (a global rank passed for a subgroup) is named, not dropped."""
    encoder, backbone = _assignments({0: [[RowSlice(A, 0, 4)]], 3: [[RowSlice(A, 0, 2)]]})
    with pytest.raises(ValueError, match=r"consumer rank 3 .*world of 2"):
        build_routing_plan(encoder, backbone, world_size=2)


def test_rank_in_two_tp_groups_is_an_error() -> None:
    """A rank listed in two TP groups (or a TP member outside the world) gives a clear error."""
    slices = {r: [[RowSlice(A, 0, 4)]] for r in range(3)}
    encoder, backbone = _assignments(slices, tp_groups=((0, 1), (1, 2)))
    with pytest.raises(ValueError, match=r"rank 1 is in TP groups \(0, 1\) and \(1, 2\)"):
        build_routing_plan(encoder, backbone, world_size=3)
    encoder, backbone = _assignments(slices, tp_groups=((0, 5),))
    with pytest.raises(ValueError, match=r"TP group \(0, 5\) .*world of 3"):
        build_routing_plan(encoder, backbone, world_size=3)


def test_sync_encoder_grads_keeps_float64() -> None:
    """sync_encoder_grads keeps each gradient's dtype: a float64 gradient is not rounded through float32."""
    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    exact = torch.tensor([1.0 + 1e-12, 1.0 / 3.0, 2.0**-40], dtype=torch.float64)
    param.grad = exact.clone()
    other = torch.nn.Parameter(torch.zeros(2, dtype=torch.float32))
    other.grad = torch.tensor([0.5, 0.25])
    sync_encoder_grads([param, other], scale=0.5)
    assert param.grad.dtype == torch.float64 and other.grad.dtype == torch.float32
    assert torch.equal(param.grad, exact * 0.5)
    assert torch.equal(other.grad, torch.tensor([0.25, 0.125]))


def test_dedup_encoder_gradients_keep_float64() -> None:
    """DedupEncoder's default gradient buffer follows dtype: float64 features give float64-exact grads."""
    plan = build_routing_plan(*_assignments({0: [[RowSlice(A, 0, 4)], [RowSlice(A, 1, 3)]]}), 1)
    weight = torch.nn.Parameter(torch.ones(4, 2, dtype=torch.float64))
    dedup = DedupEncoder(plan.for_rank(0), LocalTransport(), hidden=2, dtype=torch.float64)
    assert dedup.cache_grad.dtype == torch.float64
    dedup.encode(lambda keys: weight * 1.0)
    scale = 1.0 + 2.0**-40  # lost in float32
    for micro in range(2):
        (dedup.features(micro) * scale).sum().backward()
    dedup.backward()
    expected = torch.full((4, 2), scale, dtype=torch.float64)
    expected[1:3] += scale
    assert weight.grad is not None and torch.equal(weight.grad, expected)


def test_dedup_encoder_grad_dtype_when_asked() -> None:
    """An explicit grad_dtype wins; bfloat16 features accumulate in float32 by default."""
    plan = build_routing_plan(*_assignments({0: [[RowSlice(A, 0, 4)]]}), 1)
    route = plan.for_rank(0)
    asked = DedupEncoder(
        route, LocalTransport(), hidden=2, dtype=torch.float64, grad_dtype=torch.float32
    )
    assert asked.grad_dtype == torch.float32
    assert (
        DedupEncoder(route, LocalTransport(), hidden=2, dtype=torch.bfloat16).grad_dtype
        == torch.float32
    )
