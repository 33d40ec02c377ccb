"""Which token ranges of a written-back field are written so far: sorted, merged intervals."""

from __future__ import annotations

from collections.abc import Iterable

from knitkit.types import SeqRange


def cover(written: Iterable[SeqRange], new: Iterable[SeqRange]) -> list[SeqRange]:
    """``written`` plus ``new``, as sorted disjoint intervals (touching ones merged)."""
    out: list[SeqRange] = []
    for start, stop in sorted((a, b) for a, b in (*written, *new) if b > a):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def gaps(written: Iterable[SeqRange], length: int) -> tuple[SeqRange, ...]:
    """The ranges of ``[0, length)`` that ``written`` (sorted, disjoint) leaves out."""
    out, at = [], 0
    for start, stop in written:
        if start > at:
            out.append((at, start))
        at = max(at, stop)
    if at < length:
        out.append((at, length))
    return tuple(out)
