"""Context-parallel split: Megatron's load-balanced scheme (2*cp chunks; rank r takes r and 2cp-1-r)."""

from __future__ import annotations

import numpy as np

from knitkit.types import SeqRange


def padded_lengths(lengths: np.ndarray, multiple: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``multiple``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return -(-lengths // multiple) * multiple


def cp_chunks(padded_length: int, cp: int, rank: int) -> tuple[SeqRange, ...]:
    """Rank ``rank``'s ranges of a sequence padded to a multiple of ``2 * cp``.

    The causal-attention work of chunk r and chunk 2cp-1-r adds up to the same on every rank,
    which is why Megatron's ``get_batch_on_this_cp_rank`` takes this pair.
    """
    if cp == 1:
        return ((0, padded_length),)
    if padded_length % (2 * cp):
        raise ValueError(f"length {padded_length} is not a multiple of 2*cp={2 * cp}; pad it first")
    size = padded_length // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return ((first * size, (first + 1) * size), (second * size, (second + 1) * size))
