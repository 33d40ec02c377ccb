"""Encoder gradient sync: make every encoder replica hold the baseline's gradient after dedup."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def sync_encoder_grads(
    params: Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup | None = None,
    *,
    scale: float = 1.0,
) -> None:
    """SUM-all-reduce encoder gradients over ``group`` (one flat collective), then multiply by ``scale``.

    After a deduplicated mini-batch only the encoding ranks hold encoder gradients, each for the
    units it encoded; summed over all encoder replicas they equal the baseline's sum over
    data-parallel consumers. ``group`` must span every rank holding an encoder replica that the
    trainer does not reduce itself, and ``scale`` turns the sum into the trainer's convention
    (``1 / (dp * cp)`` for a trainer that averages; ``1`` for one that sums). Parameters without a
    gradient take part as zeros and end with one, so every replica steps identically. Gradients
    keep their parameter's dtype (one collective per dtype).

    With Megatron DDP owning the encoder parameters, see the README ("Megatron") instead.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for param in params:  # one flat collective per dtype: nothing is rounded through another dtype
        by_dtype.setdefault(param.dtype, []).append(param)
    for same in by_dtype.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in same]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        for param, piece in zip(same, flat.split([p.numel() for p in same]), strict=True):
            param.grad = piece.view_as(param)
