"""Packed (THD) micro-batches from knitkit's prefetch iterator, as the tensors a Megatron forward step takes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
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
    return _block_causal(segment_ids(local_lengths, total))


def _block_causal(owner: torch.Tensor) -> torch.Tensor:
    """``block_causal_mask`` of the tokens' sequences ``owner`` (``[T]``)."""
    total = owner.numel()
    causal = torch.ones(total, total, dtype=torch.bool, device=owner.device).triu(diagonal=1)
    return (causal | (owner[:, None] != owner[None, :]))[None, None]


@dataclass(frozen=True, slots=True)
class PackedShape:
    """What converting a packed micro-batch takes from its layout alone (its sequences' padded
    lengths, the CP size, the device): the same for every micro-batch of that layout, so
    ``PackedShapes`` builds it once (NOTE [ Conversion by layout ])."""

    owner: torch.Tensor
    """``[T]`` int64: each of this rank's tokens' sequence (padding included)."""
    num_sequences: int
    """Sequences packed (their ids in ``owner`` run ``0 .. num_sequences - 1``)."""
    longest: int | None
    """The longest whole padded sequence (``max_seqlen``); ``None`` when the layout lacks its
    host ``cu_seqlens_padded`` (read from the tensors then)."""
    mask: torch.Tensor | None = None
    """``block_causal_mask`` of the sequences, once a conversion asked for it."""

    @staticmethod
    def of(micro_batch: MicroBatch, cp_size: int = 1) -> PackedShape:
        """``micro_batch``'s shape from its layout's host ``cu_seqlens_padded`` (from the
        tensors when the layout lacks it), with no per-sequence Python."""
        padded = micro_batch["cu_seqlens_padded"]
        host = micro_batch.layout.cu_seqlens_padded
        if len(host) != padded.shape[0]:
            owner = segment_ids((padded[1:] - padded[:-1]) // cp_size)
            return PackedShape(owner, padded.shape[0] - 1, None)
        whole = np.diff(np.asarray(host, dtype=np.int64))
        local = np.floor_divide(whole, cp_size)
        if padded.device.type == "cpu":  # from the layout's host tuple
            owner = torch.from_numpy(np.repeat(np.arange(len(local)), local))
        else:  # built on the device, no host-to-device copy
            owner = segment_ids((padded[1:] - padded[:-1]) // cp_size, int(local.sum()))
        return PackedShape(owner, len(whole), int(whole.max(initial=0)))

    def masked(self) -> PackedShape:
        """This shape with its ``mask``."""
        return self if self.mask is not None else replace(self, mask=_block_causal(self.owner))

    def nbytes(self) -> int:
        mask = 0 if self.mask is None else self.mask.numel()
        return self.owner.numel() * self.owner.element_size() + mask


# NOTE [ Conversion by layout ]: what a packed micro-batch's conversion builds from its layout
# alone (each token's sequence, ``max_seqlen``, the block-causal mask) is built once per layout
# and rank (``PackedShapes``, keyed by the layout's host ``cu_seqlens_padded``, the CP size and
# the device), vectorised from the padded lengths, not per sequence in Python. Every pass of a
# mini-batch converts the same micro-batch layouts (one plan per mini-batch), so a GRPO step's
# reference and train passes find them built by its old-log-probs pass. The conversion that runs
# for every micro-batch is only what depends on its bytes: dtype casts of tokens, labels and
# loss mask, the weights, the scalars spread over their tokens; the fields it passes through
# stay views of the leased buffer (valid while the loop holds the micro-batch, read-only). The
# cached tensors are shared by every micro-batch of the layout: read-only too. GRPO's conversion
# (``examples/grpo/knit.py``'s ``grpo_batch`` plus ``MegatronRank``'s scalar fields; micro-batches
# of 123-135 tokens in 14-32-token sequences, as ``benchmarks/grpo_step.py``'s): per micro-batch
# 47 torch ops and 101 Python calls before; 21 and 40 for a layout seen before, 30 and 84 for a
# new one; a repeated layout 201-798 -> 48-146 us per micro-batch, 3 pairs at load 23-27.
class PackedShapes:
    """A rank's ``PackedShape`` of each micro-batch layout it converts, up to ``max_bytes`` of
    cached tensors (the oldest dropped first; the newest kept whatever its size): see NOTE
    [ Conversion by layout ]."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.built = 0
        """Shapes built (cache misses), for tests and figures."""
        self._shapes: dict[tuple[object, ...], PackedShape] = {}
        self._bytes = 0
        self._lock = threading.Lock()  # prefetch threads of two passes may convert at once

    def get(
        self, micro_batch: MicroBatch, cp_size: int = 1, *, attention_mask: bool = False
    ) -> PackedShape:
        """``micro_batch``'s shape (with its ``mask`` when ``attention_mask``), built once per
        layout."""
        key = (micro_batch.layout.cu_seqlens_padded, cp_size, micro_batch.flat.device)
        shape = self._shapes.get(key)
        if shape is None or (attention_mask and shape.mask is None):
            shape = shape or PackedShape.of(micro_batch, cp_size)
            shape = shape.masked() if attention_mask else shape
            self.built += 1
            if shape.longest is not None:  # a layout that names its sequences
                self._keep(key, shape)
        return shape

    def _keep(self, key: tuple[object, ...], shape: PackedShape) -> None:
        with self._lock:
            old = self._shapes.pop(key, None)
            self._bytes += shape.nbytes() - (0 if old is None else old.nbytes())
            self._shapes[key] = shape
            while self._bytes > self.max_bytes and len(self._shapes) > 1:
                self._bytes -= self._shapes.pop(next(iter(self._shapes))).nbytes()


def token_sequence_ids(micro_batch: MicroBatch, cp_size: int = 1) -> torch.Tensor:
    """Each of this rank's tokens' sequence in a packed micro-batch, ``[T]`` int64 (padding
    included; under CP a rank holds ``1/cp_size`` of every sequence), with no device-to-host
    sync when the layout carries its host ``cu_seqlens_padded`` (``PackedShape.of``)."""
    return PackedShape.of(micro_batch, cp_size).owner


def megatron_batch(
    micro_batch: MicroBatch,
    *,
    cp_size: int = 1,
    attention_mask: bool = False,
    shapes: PackedShapes | None = None,
) -> Batch:
    """One packed micro-batch as Megatron tensors: ``[1, T]`` tokens, labels, loss mask, position ids.

    Stored fields follow NOTE [ Next-token alignment ] (``knitkit/next_token.py``: position t
    predicts token t+1) and pass through as they are: ``labels``, ``loss_mask`` and, when
    ``logprobs`` was stored, ``rollout_log_probs`` (the rollout's log-prob of each position's
    label, for a PPO ratio). Without a stored ``labels`` field (CP=1 only: under CP a rank does
    not hold each token's successor) labels are the tokens shifted left within each sequence and
    the last position of every sequence is masked out. ``attention_mask=True`` adds
    ``block_causal_mask`` for attention without THD support (CP=1 only). ``shapes``: the rank's
    cache of what the layout alone fixes (NOTE [ Conversion by layout ]); without one it is
    built for this micro-batch.
    """
    if attention_mask and cp_size > 1:
        raise ValueError("block_causal_mask covers CP=1 only; use THD attention (TE) under CP")
    if shapes is not None:
        shape = shapes.get(micro_batch, cp_size, attention_mask=attention_mask)
    else:
        shape = PackedShape.of(micro_batch, cp_size)
        shape = shape.masked() if attention_mask else shape
    tokens = micro_batch["tokens"].long()
    loss_mask = micro_batch["loss_mask"].float()
    cu_seqlens = micro_batch["cu_seqlens"]
    cu_padded = micro_batch["cu_seqlens_padded"]
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
    batch: Batch = {
        "tokens": tokens.unsqueeze(0),
        "labels": labels.unsqueeze(0),
        "loss_mask": loss_mask.unsqueeze(0),
        "position_ids": micro_batch["position_ids"].long().unsqueeze(0),
        "packed_seq_params": packed_seq_params(cu_seqlens, cu_padded, shape.longest),
    }
    if "logprobs" in micro_batch.tensors:
        batch["rollout_log_probs"] = micro_batch["logprobs"].float().unsqueeze(0)
    if shape.mask is not None and attention_mask:
        batch["attention_mask"] = shape.mask
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
