"""Vision-path gradients under Megatron DDP: the deferred backward, its zero anchor, the TP sum."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from knitkit.encoder_dedup import DedupEncoder

# NOTE [vision gradients under Megatron DDP]: with a replicated vision path each unique input is
# encoded on ONE rank of the world, so an encoder replica's gradient covers only the inputs it
# encoded. Megatron DDP averages over DP (x CP) but never reduces replicated parameters over TP;
# the step therefore SUM-reduces the vision parameters' ``main_grad`` over the TP group right
# after finalize. Both reductions are linear, so their order does not change the result, and
# summing after finalize never races an in-flight bucket reduction of ``overlap_grad_reduce``.
# A rank that encodes nothing back-propagates a zero through its vision parameters, so DDP sees
# the same gradient-ready events on every rank and every mini-batch (with overlap on, a bucket
# whose parameters never got a gradient fails "Communication call has not been issued").
# A TP-sharded vision path is encoded by all TP peers together (each holds the full, identical
# feature gradient), so it needs no sum.


@dataclass(slots=True)
class DeferredVisionBackward:
    """The mini-batch's deferred encoder backward, plus the zero anchor of a rank that encoded nothing."""

    dedup: DedupEncoder
    params: tuple[torch.nn.Parameter, ...]

    def backward(self) -> None:
        self.dedup.backward()
        if self.dedup.encoded_units == 0 and self.params:
            torch.autograd.backward(torch.stack([p.sum() for p in self.params]).sum() * 0.0)


def finalize_then_sum(
    finalize: Callable[..., object],
    params: tuple[torch.nn.Parameter, ...],
    tp_group: dist.ProcessGroup | None,
    *args: object,
    **kwargs: object,
) -> object:
    """Megatron's finalize, then the vision gradients SUM-reduced over ``tp_group`` (NOTE above)."""
    out = finalize(*args, **kwargs)
    if params and tp_group is not None and dist.get_world_size(tp_group) > 1:
        grads = [_grad_of(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_group)
        for grad, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(piece.view_as(grad))
    return out


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    """Where the parameter's gradient lives: Megatron DDP's ``main_grad`` buffer, else ``.grad``."""
    grad = getattr(param, "main_grad", None)
    if grad is None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
    return grad
