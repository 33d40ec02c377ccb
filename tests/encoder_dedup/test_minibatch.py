"""train_minibatch returns its losses as one tensor, stacked once: no host sync per micro-batch (issue 31.3)."""

from __future__ import annotations

import torch

from knitkit.encoder_dedup import (
    BackboneAssignment,
    DedupEncoder,
    EncoderAssignment,
    LocalTransport,
    RowSlice,
    build_routing_plan,
    train_minibatch,
)
from knitkit.types import UnitKey

A, B = UnitKey("a", "image"), UnitKey("b", "image")
ROWS = {A: 4, B: 2}


def _run(device: str) -> tuple[torch.Tensor, list[float]]:
    """One mini-batch of two micro-batches; the losses returned and each one as the backbone saw
    it (the old per-micro-batch floats, taken here in the test, not in the step)."""
    encoder = EncoderAssignment({0: [[A, B]]}, ROWS)
    backbone = BackboneAssignment(
        {0: [[RowSlice(A, 0, 4), RowSlice(B, 0, 2)], [RowSlice(A, 1, 3)]]}
    )
    route = build_routing_plan(encoder, backbone, world_size=1).for_rank(0)
    dedup = DedupEncoder(route, LocalTransport(), hidden=3, device=torch.device(device))
    weight = torch.nn.Parameter(torch.arange(3.0, device=device)[None] + 1)
    seen: list[torch.Tensor] = []

    def step(micro: int, features: torch.Tensor) -> torch.Tensor:
        loss = features.square().mean() * (micro + 1)
        seen.append(loss.detach().clone())
        return loss

    losses = train_minibatch(
        dedup, lambda keys: weight.expand(sum(ROWS[k] for k in keys), 3) * 2.0, step
    )
    return losses, [float(loss) for loss in seen]


def test_losses_are_one_tensor_equal_to_the_per_micro_batch_floats() -> None:
    """The step hands back a detached ``[num_micro_batches]`` tensor whose values are exactly
    the floats the old API returned one by one."""
    losses, floats = _run("cpu")
    assert isinstance(losses, torch.Tensor) and not losses.requires_grad
    assert losses.shape == (2,)
    assert losses.tolist() == floats
