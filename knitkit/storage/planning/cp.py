"""Context-parallel split: Megatron's load-balanced scheme (2*cp chunks; rank r takes r and 2cp-1-r)."""

from __future__ import annotations

from collections.abc import Iterable

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
    return _chunks(padded, cp, [rank])[0]


def chunks_by_rank(padded: np.ndarray, cp: int) -> list[list[tuple[SeqRange, ...]]]:
    """``rank_chunks`` of every CP rank at once (the ranks share their boundary ints)."""
    return _chunks(padded, cp, range(cp))


def _chunks(padded: np.ndarray, cp: int, ranks: Iterable[int]) -> list[list[tuple[SeqRange, ...]]]:
    padded = np.asarray(padded, dtype=np.int64)
    if cp == 1:
        return [[((0, n),) for n in padded.tolist()] for _ in ranks]
    bad = padded % (2 * cp) != 0
    if bad.any():
        raise ValueError(
            f"lengths {padded[bad][:5].tolist()} are not multiples of 2*cp={2 * cp}; pad them"
        )
    size = padded // (2 * cp)
    bounds: dict[int, list[int]] = {}  # chunk boundary j of every sequence: j * size

    def bound(j: int) -> list[int]:
        if j not in bounds:
            bounds[j] = (size * j).tolist()
        return bounds[j]

    out: list[list[tuple[SeqRange, ...]]] = []
    for rank in ranks:
        first = zip(bound(rank), bound(rank + 1), strict=True)
        second = zip(bound(2 * cp - 1 - rank), bound(2 * cp - rank), strict=True)
        out.append(list(zip(first, second, strict=True)))
    return out


def cp_chunks(padded_length: int, cp: int, rank: int) -> tuple[SeqRange, ...]:
    """``rank_chunks`` of a single sequence."""
    return rank_chunks(np.array([padded_length]), cp, rank)[0]
