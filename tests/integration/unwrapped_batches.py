"""The unwrapped reference's batches for the Megatron equivalence tests: each carries the image pieces it consumes."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from knitkit.encoder_dedup import feature_slices
from knitkit.storage import MicroBatchPlan
from knitkit.types import UnitKey


def with_images(
    micro_batches: Sequence[MicroBatchPlan],
    batches: Iterable[Mapping[str, object]],
    load: Callable[[UnitKey], torch.Tensor],
) -> Iterator[dict[str, object]]:
    """Each batch plus ``images``: the (unit, first row, end row) pieces its micro-batch consumes."""
    for batch, micro_batch in zip(batches, micro_batches, strict=True):
        pieces = feature_slices(micro_batch)
        yield dict(batch, images=[(load(s.key), s.start, s.stop) for s in pieces])
