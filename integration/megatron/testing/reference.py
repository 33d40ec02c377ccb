"""The unwrapped baseline of the check: every micro-batch re-encodes the unit pieces it consumes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from knitkit.encoder_dedup import RowSlice
from knitkit.integration.megatron.step import CountingIterator
from knitkit.types import UnitKey


class ReencodingVision(torch.nn.Module):
    """Stands in for the vision path of the reference model: re-encodes the current micro-batch's pieces.

    NOTE [ Re-encoding reference ]: the unwrapped step runs the vision path inside every
    micro-batch on the inputs its placeholder tokens consume, so an image shared by n rollouts is
    encoded n times and back-propagated n times, each inside its micro-batch's backward. This
    module reproduces exactly that from the plan: in micro-batch ``i`` it encodes every unit
    piece ``slices[i]`` names (one ``encode`` per piece, graph kept) and returns their rows in
    feature order, so the reference needs nothing of the user's batch format. The real vision
    path stays registered as ``inner``: megatron's ``finalize_model_grads`` walks
    ``named_parameters`` and must still reach every vision parameter (as in NOTE [ Finalize sees
    the vision path ] of the wrapped step).
    """

    def __init__(
        self,
        inner: torch.nn.Module,
        encode: Callable[[torch.Tensor], torch.Tensor],
        load: Callable[[UnitKey], torch.Tensor],
        slices: Sequence[Sequence[RowSlice]],
        feed: CountingIterator,
        empty: torch.Tensor,
    ) -> None:
        super().__init__()
        self.inner = inner
        self._encode, self._load, self._slices, self._feed = encode, load, slices, feed
        self._empty = empty
        self.encoded_units = 0

    def forward(self, *unused: object, **unused_kw: object) -> torch.Tensor:
        if self._feed.count == 0:
            raise RuntimeError("the vision path ran before the forward step took its micro-batch")
        pieces = self._slices[self._feed.count - 1]
        self.encoded_units += len(pieces)
        rows = [self._encode(self._load(s.key))[s.start : s.stop] for s in pieces]
        return torch.cat(rows) if rows else self._empty


@contextlib.contextmanager
def swapped(model: torch.nn.Module, dotted: str, stand_in: torch.nn.Module) -> Iterator[None]:
    """Put ``stand_in`` at the dotted attribute path of ``model`` for the duration of the block."""
    *path, name = dotted.split(".")
    parent = model
    for part in path:
        parent = getattr(parent, part)
    original = getattr(parent, name)
    setattr(parent, name, stand_in)
    try:
        yield
    finally:
        setattr(parent, name, original)
