"""Packed (THD) micro-batches from knitkit's prefetch iterator, as the tensors a Megatron forward step takes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from knitkit.encoder_dedup import segment_ids
from knitkit.microbatch_iter import MicroBatch

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

Batch = dict[str, object]
"""What a forward step gets from ``next(data_iterator)``: tensors plus ``packed_seq_params``."""


def packed_seq_params(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, max_seqlen: int | None = None
) -> PackedSeqParams:
    """Megatron's ``PackedSeqParams`` (THD) for packed sequences, as ``get_thd_batch_on_this_cp_rank`` builds it.

    ``cu_seqlens`` are the cumulative real lengths and ``cu_seqlens_padded`` the cumulative
    padded lengths of the WHOLE sequences (under CP each rank holds ``1/cp`` of every one).
    ``max_seqlen``: the longest padded sequence when the caller knows it on the host (a packed
    micro-batch's ``layout.cu_seqlens_padded``); without it, it is read from the tensors, a
    device-to-host sync when they live on a GPU.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = cu_seqlens.to(torch.int32)
    cu_seqlens_padded = cu_seqlens_padded.to(torch.int32)
    if max_seqlen is None:
        max_seqlen = (
            int((cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).max())
            if len(cu_seqlens) > 1
            else 0
        )
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


def block_causal_mask(local_lengths: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``[1, 1, T, T]`` boolean mask (True = masked) of causal attention within each packed sequence.

    For attention without THD support (megatron-core's local ``DotProductAttention``, CP=1):
    equivalent to THD attention over the same packed sequences, at ``T^2`` memory. ``total``
    (``T``, the sum of ``local_lengths``) spares a device-to-host sync when the caller knows it.
    """
    owner = segment_ids(local_lengths, total)
    total = owner.numel()
    causal = torch.ones(total, total, dtype=torch.bool, device=owner.device).triu(diagonal=1)
    return (causal | (owner[:, None] != owner[None, :]))[None, None]


def token_sequence_ids(micro_batch: MicroBatch, cp_size: int = 1) -> torch.Tensor:
    """Each of this rank's tokens' sequence in a packed micro-batch, ``[T]`` int64 (padding
    included; under CP a rank holds ``1/cp_size`` of every sequence), off torch's intra-op pool
    (NOTE [ Segment ids off the intra-op pool ] in knitkit/encoder_dedup/segments.py) and with
    no device-to-host sync when the layout carries its host ``cu_seqlens_padded``."""
    padded = micro_batch["cu_seqlens_padded"]
    host = micro_batch.layout.cu_seqlens_padded
    total = (
        sum((b - a) // cp_size for a, b in itertools.pairwise(host))
        if len(host) == padded.shape[0]
        else None
    )
    return segment_ids((padded[1:] - padded[:-1]) // cp_size, total)


def megatron_batch(
    micro_batch: MicroBatch, *, cp_size: int = 1, attention_mask: bool = False
) -> Batch:
    """One packed micro-batch as Megatron tensors: ``[1, T]`` tokens, labels, loss mask, position ids.

    Stored fields follow NOTE [ Next-token alignment ] (``knitkit/next_token.py``: position t
    predicts token t+1) and pass through as they are: ``labels``, ``loss_mask`` and, when
    ``logprobs`` was stored, ``rollout_log_probs`` (the rollout's log-prob of each position's
    label, for a PPO ratio). Without a stored ``labels`` field (CP=1 only: under CP a rank does
    not hold each token's successor) labels are the tokens shifted left within each sequence and
    the last position of every sequence is masked out. ``attention_mask=True`` adds
    ``block_causal_mask`` for attention without THD support (CP=1 only).
    """
    tokens = micro_batch["tokens"].long()
    loss_mask = micro_batch["loss_mask"].float()
    cu_seqlens = micro_batch["cu_seqlens"]
    cu_padded = micro_batch["cu_seqlens_padded"]
    local_lengths = (cu_padded[1:] - cu_padded[:-1]) // cp_size
    if "labels" in micro_batch.tensors:
        labels = micro_batch["labels"].long()
    elif cp_size > 1:
        raise ValueError(
            "under context parallelism a rank does not hold each token's successor; "
            "store a per-token 'labels' field and plan it with the tokens"
        )
    else:
        # Each non-empty sequence's last position, as a mask built without a boolean index (that
        # would be a device-to-host sync per micro-batch on a GPU; issue 31).
        real = cu_seqlens[1:] - cu_seqlens[:-1]
        last = (cu_padded[:-1] + real - 1).clamp(min=0).long()
        hits = torch.zeros(tokens.shape[0], dtype=torch.int32, device=tokens.device)
        is_last = hits.index_add_(0, last, (real > 0).to(torch.int32)) > 0
        labels = torch.roll(tokens, -1).masked_fill_(is_last, 0)
        loss_mask = loss_mask.masked_fill(is_last, 0.0)
    padded = micro_batch.layout.cu_seqlens_padded  # a packed layout's host copy: no sync
    longest = (
        max((b - a for a, b in itertools.pairwise(padded)), default=0)
        if len(padded) == cu_padded.shape[0]
        else None
    )
    batch: Batch = {
        "tokens": tokens[None],
        "labels": labels[None],
        "loss_mask": loss_mask[None],
        "position_ids": micro_batch["position_ids"].long()[None],
        "packed_seq_params": packed_seq_params(cu_seqlens, cu_padded, longest),
    }
    if "logprobs" in micro_batch.tensors:
        batch["rollout_log_probs"] = micro_batch["logprobs"].float()[None]
    if attention_mask:
        if cp_size > 1:
            raise ValueError("block_causal_mask covers CP=1 only; use THD attention (TE) under CP")
        batch["attention_mask"] = block_causal_mask(local_lengths, tokens.shape[0])
    return batch


def megatron_batches(
    micro_batches: Iterable[MicroBatch],
    to_batch: Callable[[MicroBatch], Mapping[str, object]] = megatron_batch,
) -> Iterator[Mapping[str, object]]:
    """The data iterator for ``get_forward_backward_func()``: knitkit's prefetch iterator, converted.

    A prefetched micro-batch's tensors live in a staging slot that is refilled once the ring
    comes round; megatron's no-pipelining schedule finishes each micro-batch's backward before the
    next ``next()``, so views are safe there. Clone in ``to_batch`` when the schedule holds several
    micro-batches in flight (pipeline parallelism) or the prefetch depth is small.
    """
    for micro_batch in micro_batches:
        yield to_batch(micro_batch)
