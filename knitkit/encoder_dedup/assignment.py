"""What the encoder and the backbone consume in one mini-batch: unit partitions and row slices."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from knitkit.types import MultimodalRef, SeqRange, UnitKey


@dataclass(frozen=True, slots=True, order=True)
class RowSlice:
    """Rows ``[start, stop)`` of one multimodal unit's encoding (row i = the unit's i-th placeholder token)."""

    key: UnitKey
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class EncoderAssignment:
    """The encoder's own partition: encoder micro-batches of unique units, per encoding rank."""

    micro_batches: Mapping[int, Sequence[Sequence[UnitKey]]]
    """Rank -> its encoder micro-batches, each a sequence of unit keys encoded together, in order."""
    num_rows: Mapping[UnitKey, int]
    """Encoding rows of every unit (= ``MultimodalRef.num_tokens``)."""


@dataclass(frozen=True, slots=True)
class BackboneAssignment:
    """What each backbone rank consumes: per backbone micro-batch, the encoding rows in feature order."""

    micro_batches: Mapping[int, Sequence[Sequence[RowSlice]]]
    """Rank -> its backbone micro-batches, each the row slices its features are gathered from, in order."""
    tp_groups: Sequence[Sequence[int]] = ()
    """Tensor-parallel replica groups; members consume identical micro-batches. Unlisted ranks: TP=1."""


def row_slices(
    refs: Sequence[MultimodalRef], seq_ranges: Sequence[SeqRange]
) -> tuple[RowSlice, ...]:
    """Encoding rows a consumer needs for a trajectory of which it holds ``seq_ranges`` (in order).

    A CP rank holding zigzag chunks, or a micro-batch holding one piece of a trajectory, passes its
    ranges; each multimodal input contributes the rows whose placeholder positions fall inside them.
    """
    ordered = sorted(refs, key=lambda ref: ref.token_start)
    slices: list[RowSlice] = []
    for lo, hi in seq_ranges:
        for ref in ordered:
            start = max(lo, ref.token_start)
            stop = min(hi, ref.token_start + ref.num_tokens)
            if start < stop:
                slices.append(RowSlice(ref.key, start - ref.token_start, stop - ref.token_start))
    return tuple(slices)
