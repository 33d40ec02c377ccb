"""Context-parallel split: Megatron's load-balanced scheme (2*cp chunks; rank r takes r and 2cp-1-r)."""

from __future__ import annotations

import numpy as np

from knitkit.types import SeqRange


def padded_lengths(lengths: np.ndarray, multiple: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``multiple``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return -(-lengths // multiple) * multiple


def rank_chunks(padded: np.ndarray, cp: int, rank: int) -> list[tuple[SeqRange, ...]]:
    """CP rank ``rank``'s ranges of each sequence, all padded to multiples of ``2 * cp``.

    The causal-attention work of chunk r and chunk 2cp-1-r adds up to the same on every rank,
    which is why Megatron's ``get_batch_on_this_cp_rank`` takes this pair.
    """
    padded = np.asarray(padded, dtype=np.int64)
    if cp == 1:
        return [((0, n),) for n in padded.tolist()]
    bad = padded % (2 * cp) != 0
    if bad.any():
        raise ValueError(
            f"lengths {padded[bad][:5].tolist()} are not multiples of 2*cp={2 * cp}; pad them"
        )
    size = padded // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    starts = zip((size * first).tolist(), (size * (first + 1)).tolist(), strict=True)
    ends = zip((size * second).tolist(), (size * (second + 1)).tolist(), strict=True)
    return list(zip(starts, ends, strict=True))


def cp_chunks(padded_length: int, cp: int, rank: int) -> tuple[SeqRange, ...]:
    """``rank_chunks`` of a single sequence."""
    return rank_chunks(np.array([padded_length]), cp, rank)[0]
