"""GRPO's loss on megatron's per-token output: PPO-clipped policy gradient plus a KL term to the reference."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from knitkit.encoder_dedup import segment_ids

Batch = Mapping[str, Any]
"""One micro-batch as the forward step takes it (both data paths build the same keys):
``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ``[b, s]``, ``attention_mask`` (or
``packed_seq_params`` for THD attention), ``images`` when the model encodes them itself, and
``weights`` (``token_weights``), and for the train pass ``advantage`` and ``reward`` (each
sequence's over its tokens), ``old_logprobs`` and ``ref_logprobs`` ``[b, s]``."""
LossOut = tuple[torch.Tensor, dict[str, torch.Tensor]]


@dataclass(frozen=True, kw_only=True, slots=True)
class LossConfig:
    """GRPO's objective."""

    clip_eps: float = 0.2
    """PPO's ratio clip: ``ratio`` is clipped to ``[1 - clip_eps, 1 + clip_eps]``."""
    kl_coef: float = 0.05
    """Weight of the KL term to the frozen reference (the k3 estimator, as in GRPO)."""


def token_weights(loss_mask: torch.Tensor, lengths: torch.Tensor, sequences: int) -> torch.Tensor:
    """Per-token weights of GRPO's sequence mean: ``loss_mask / (|o_i| * G)``.

    ``loss_mask`` is ``[T]`` for sequences of ``lengths`` tokens laid end to end (padding
    included); ``|o_i|`` is sequence i's count of trained tokens and ``G`` the mini-batch's
    number of sequences (``sequences``), so the weights of the whole mini-batch sum to 1.
    """
    owner = segment_ids(lengths.to(loss_mask.device), loss_mask.shape[0])
    return sequence_weights(loss_mask, owner, len(lengths), sequences)


def sequence_weights(
    loss_mask: torch.Tensor, owner: torch.Tensor, num_sequences: int, sequences: int
) -> torch.Tensor:
    """``token_weights`` of tokens whose sequences (``0 .. num_sequences - 1``) are ``owner``
    (``[T]``, e.g. a packed micro-batch's cached ``PackedShape.owner``)."""
    counts = torch.zeros(num_sequences, dtype=loss_mask.dtype, device=loss_mask.device)
    counts.index_add_(0, owner, loss_mask)
    return loss_mask / (counts.clamp(min=1).index_select(0, owner) * sequences)


def forward(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The tiny VLM's forward: per-token ``-log p(label)`` ``[b, s]`` (megatron's output with labels)."""
    thd = "attention_mask" not in batch
    return model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        batch["labels"],
        images=batch.get("images"),
        packed_seq_params=batch["packed_seq_params"] if thd else None,
    )


def logprob_step(
    data_iterator: Iterator[Batch], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    """Forward step of a forward-only pass (old / reference log-probs): the schedule collects
    ``{"logprobs": [b, s]}`` per micro-batch, in order."""
    batch = next(data_iterator)
    output = forward(model, batch)
    return output, functools.partial(_logprobs, batch["loss_mask"])


def _logprobs(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[Any, ...]:
    tokens = loss_mask.sum().to(torch.int)
    return output.sum() * 0.0, tokens, {"logprobs": -output.detach().float()}


def train_step(
    config: LossConfig, scale: float, data_iterator: Iterator[Batch], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], LossOut]]:
    """Forward step of the train pass (bind ``config`` and ``scale`` with ``functools.partial``)."""
    batch = next(data_iterator)
    output = forward(model, batch)
    return output, functools.partial(grpo_loss, config, scale, batch)


def grpo_loss(config: LossConfig, scale: float, batch: Batch, output: torch.Tensor) -> LossOut:
    """PPO-clipped surrogate plus ``kl_coef`` times the k3 KL to the reference, GRPO's sequence mean.

    Returns the loss megatron back-propagates (times ``scale``, see NOTE [ GRPO loss scale ])
    and this micro-batch's unscaled weighted sums (over a mini-batch they are sequence means):
    ``loss``, ``pg``, ``kl``, ``nll`` (``-log p`` of the trained tokens), ``reward``,
    ``clipped`` (fraction of clipped tokens) and ``sequences`` (its share of the weight, 1 in all).
    """
    logp = -output.float()
    ratio = torch.exp(logp - batch["old_logprobs"])
    advantages = batch["advantage"]
    clipped = ratio.clamp(1.0 - config.clip_eps, 1.0 + config.clip_eps)
    pg = -torch.minimum(ratio * advantages, clipped * advantages)
    delta = batch["ref_logprobs"] - logp
    kl = torch.exp(delta) - delta - 1.0
    weights = batch["weights"]
    objective = ((pg + config.kl_coef * kl) * weights).sum()
    figures = {
        "loss": objective.detach(),
        "pg": (pg * weights).sum().detach(),
        "kl": (kl * weights).sum().detach(),
        "nll": (-logp * weights).sum().detach(),
        "reward": (batch["reward"] * weights).sum().detach(),
        "clipped": ((ratio != clipped).float() * weights).sum().detach(),
        "sequences": weights.sum().detach(),
    }
    return objective * scale, figures


def loss_scale(num_microbatches: int) -> float:
    """What megatron's reductions take off the loss, put back (see NOTE [ GRPO loss scale ]).

    NOTE [ GRPO loss scale ]: GRPO's objective is a sum over the mini-batch with per-token weights
    ``1 / (|o_i| * G)`` (``token_weights``), the same whichever rank or micro-batch holds a
    token, so the two data paths may cut the mini-batch differently and still compute the same
    gradient. Megatron divides each micro-batch's loss by ``num_microbatches`` (the 2-tuple
    loss form; it also multiplies by the CP size, undone by DDP's average over DP x CP) and
    DDP averages gradients over DP: the loss is multiplied back by ``DP * num_microbatches``,
    as slime does for its sample-mean loss. The tokens of a sequence split over CP ranks each
    carry their weight, so the sum stays exact under CP given the whole sequence's ``|o_i|``.
    """
    from megatron.core import parallel_state

    return float(parallel_state.get_data_parallel_world_size() * num_microbatches)
