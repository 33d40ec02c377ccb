"""Vision-path gradients under Megatron DDP: the deferred backward, its zero anchor, the TP sum."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from knitkit.encoder_dedup import DedupEncoder

# NOTE [ Vision gradients under Megatron DDP ]: with a replicated vision path each unique input is
# encoded on ONE rank of the world, so an encoder replica's gradient covers only the inputs it
# encoded: the replicas' gradients must be SUMMED over TP, which Megatron DDP (DP x CP) never
# reduces. The step joins megatron's own TP reduction in ``finalize_model_grads`` (the one
# coalesced all-reduce it runs for q/k layernorms and TP-domain-averaged parameters) instead of
# adding a collective: the deferred backward scales the routed feature gradients by ``tp`` and
# the vision parameters carry ``average_gradients_across_tp_domain`` for the length of the step,
# so finalize's TP average of ``tp * partial`` is the sum. Scaling the feature gradients before
# the encoder backward, not ``main_grad`` after it, keeps clear of bucket reductions already in
# flight under ``overlap_grad_reduce``. Parameters finalize already reduces over TP keep that:
# SUMmed ones (``sequence_parallel``-tagged under SP, q/k layernorms under ``qk_layernorm``) end
# with ``tp`` times the sum, which is what the unwrapped step's identical replicas add up to;
# already-averaged ones end with the sum. It needs finalize to see the vision path (NOTE
# [ Finalize sees the vision path ] in step.py).
# A rank that encodes nothing back-propagates a zero through its vision parameters, so DDP sees
# the same gradient-ready events on every rank and every mini-batch (with overlap on, a bucket
# whose parameters never got a gradient fails "Communication call has not been issued").
# A TP-sharded vision path is encoded by all TP peers together (each holds the full, identical
# feature gradient), so it needs neither the scale nor the tags.

_AVERAGED = "average_gradients_across_tp_domain"


@dataclass(slots=True)
class DeferredVisionBackward:
    """The mini-batch's deferred encoder backward, plus the zero anchor of a rank that encoded nothing."""

    dedup: DedupEncoder
    params: tuple[torch.nn.Parameter, ...]
    scale: float = 1.0
    """Multiplies the routed feature gradients (``tp`` for a replicated vision path; see
    NOTE [ Vision gradients under Megatron DDP ])."""

    def backward(self) -> None:
        self.dedup.backward(scale=self.scale)
        if self.dedup.encoded_units == 0 and self.params:
            torch.autograd.backward(torch.stack([p.sum() for p in self.params]).sum() * 0.0)


@contextlib.contextmanager
def averaged_over_tp(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], config: object
) -> Iterator[None]:
    """Tag the parameters finalize would not reduce over TP ``average_gradients_across_tp_domain``
    while the block runs (NOTE [ Vision gradients under Megatron DDP ]); untag them after."""
    tagged = [
        (param, param.__dict__.get(_AVERAGED, _ABSENT))
        for name, param in named_params
        if not getattr(param, _AVERAGED, False) and not _summed_over_tp(name, param, config)
    ]
    for param, _ in tagged:
        setattr(param, _AVERAGED, True)
    try:
        yield
    finally:
        for param, before in tagged:
            if before is _ABSENT:
                delattr(param, _AVERAGED)
            else:
                setattr(param, _AVERAGED, before)


_ABSENT = object()


def _summed_over_tp(name: str, param: torch.nn.Parameter, config: object) -> bool:
    """Whether megatron's ``finalize_model_grads`` already SUMs this parameter over TP (0.16)."""
    if getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False):
        return True
    return bool(getattr(config, "qk_layernorm", False)) and (
        "q_layernorm" in name or "k_layernorm" in name
    )
