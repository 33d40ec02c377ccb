"""The unwrapped baseline of the check: the model's own forward, its real vision path fed the images."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from knitkit.encoder_dedup import feature_slices
from knitkit.storage import MicroBatchPlan
from knitkit.types import UnitKey

ImagePiece = tuple[torch.Tensor, int, int]
"""One piece of a unit a micro-batch consumes: (the unit's stored input, first row, end row)."""


def with_images(
    micro_batches: Sequence[MicroBatchPlan],
    batches: Iterable[Mapping[str, object]],
    load: Callable[[UnitKey], torch.Tensor],
) -> Iterator[dict[str, object]]:
    """The reference's batches: each of the wrap's batches plus ``images``, its micro-batch's pieces.

    NOTE [ Re-encoding reference ]: the unwrapped step runs the vision path inside every
    micro-batch on the inputs its placeholder tokens consume, so an image shared by n rollouts is
    encoded n times and back-propagated n times, each inside its micro-batch's backward. The
    check's reference is exactly that, with nothing of the wrap in it: megatron's schedule runs
    the user's forward step on the unwrapped model, whose real forward calls its real vision path
    on ``batch["images"]``: per piece of a unit the micro-batch consumes, in placeholder order,
    ``(the unit's stored input, first row, end row)``, the features being
    ``torch.cat([vision(x)[a:b] for x, a, b in images])``. The user's per-unit encoder
    (``VLMUnderTest.encoder``) runs only in the wrap: were it the reference's too, a wrong encoder
    (rows reversed, a trunk detached from autograd) would agree with itself. A model that takes
    its images in another form names its own batches (``VLMUnderTest.reference_batches``).
    """
    for batch, micro_batch in zip(batches, micro_batches, strict=True):
        pieces = [(load(s.key), s.start, s.stop) for s in feature_slices(micro_batch)]
        yield dict(batch, images=pieces)


class CallCounter:
    """Counts the calls of a module's forward while installed (``with``); removes its hook after."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.calls = module, 0
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    def __enter__(self) -> CallCounter:
        self._handle = self.module.register_forward_hook(self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()

    def _count(self, *unused: object) -> None:
        self.calls += 1
