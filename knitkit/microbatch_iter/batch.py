"""What the iterator yields: a micro-batch as named tensors over one staged buffer, with its stats."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from knitkit.types import LAYOUT_ALIGNMENT, FieldView, MicroBatchLayout


@dataclass(frozen=True, slots=True)
class MicroBatchStats:
    """Timings and size of one delivered micro-batch."""

    index: int
    wait_s: float
    """Time the training loop spent inside ``next()`` for it: exposed data wait plus hand-over."""
    fetch_s: float
    """Time the prefetch thread spent in ``next(source)`` (e.g. waiting for the reorganizer)."""
    stage_s: float
    """Host copy into the staging slot plus issuing the device copy."""
    nbytes: int


@dataclass(slots=True)
class IterStats:
    """Totals over the micro-batches an iterator has delivered."""

    count: int = 0
    wait_s: float = 0.0
    first_wait_s: float = 0.0
    """Wait for the first micro-batch: its preparation cannot overlap any compute."""
    fetch_s: float = 0.0
    stage_s: float = 0.0
    nbytes: int = 0
    h2d_s: float = 0.0
    """Device time of the host-to-device copies (CUDA with ``time_h2d=True`` only, after close)."""

    def add(self, mb: MicroBatchStats) -> None:
        if self.count == 0:
            self.first_wait_s = mb.wait_s
        self.count += 1
        self.wait_s += mb.wait_s
        self.fetch_s += mb.fetch_s
        self.stage_s += mb.stage_s
        self.nbytes += mb.nbytes

    @property
    def steady_wait_s(self) -> float:
        """Exposed wait after the first micro-batch: what overlap is meant to hide."""
        return self.wait_s - self.first_wait_s


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One delivered micro-batch: field tensors viewing one flat staged buffer.

    The tensors live in a staging slot that is refilled once the ring comes round again, or
    on CPU in the source's published slot itself (NOTE [ Zero-copy hand-off ] in worker.py):
    they stay valid until the next ``next()`` call and must not be written into; ``clone()``
    what must live longer or be modified.
    """

    index: int
    layout: MicroBatchLayout
    flat: torch.Tensor
    """The packed bytes (uint8) on the target device; ``tensors`` are views of it."""
    tensors: Mapping[str, torch.Tensor]
    stats: MicroBatchStats

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(
                f"micro-batch has no field {name!r}; fields: {list(self.tensors)}"
            ) from None


def field_tensors(
    flat: torch.Tensor,
    layout: MicroBatchLayout,
    overrides: Mapping[str, torch.dtype] | None = None,
) -> dict[str, torch.Tensor]:
    """Zero-copy tensor views of every field of ``layout`` over the flat uint8 tensor ``flat``,
    on any device.

    One construction path, one torch call per field: ``flat`` is viewed once per dtype, and each
    field is an ``as_strided`` view of that at the field's precomputed element offset (a slice,
    a dtype view and a reshape per field cost 5x more: ~76 against ~15 us for 9 fields, issue 31).
    ``overrides`` gives a field another dtype of the same width (bfloat16 over "uint16").
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < layout.nbytes:
        raise ValueError(
            f"field views need a flat uint8 tensor of at least {layout.nbytes} bytes; got "
            f"{flat.dtype} of shape {tuple(flat.shape)}"
        )
    if flat.numel() % LAYOUT_ALIGNMENT:  # a view as a wider dtype needs whole items
        flat = flat[: flat.numel() - flat.numel() % LAYOUT_ALIGNMENT]
    first = flat.storage_offset()
    typed: dict[str, tuple[torch.Tensor, int, int]] = {}
    views = {}
    for view in layout.fields:
        key = view.dtype if not overrides or view.name not in overrides else view.name
        base = typed.get(key)
        if base is None:
            dtype = overrides[view.name] if key == view.name else torch_dtype(view.dtype)
            base = typed[key] = _typed(flat, dtype, first, view)
        tensor, start, itemsize = base
        shape = view.shape
        strides = (1,) if len(shape) == 1 else _contiguous(shape)
        views[view.name] = tensor.as_strided(shape, strides, start + view.offset // itemsize)
    return views


def _typed(
    flat: torch.Tensor, dtype: torch.dtype, first: int, field: FieldView
) -> tuple[torch.Tensor, int, int]:
    """``flat`` viewed as ``dtype``, the storage offset (in items) of its first byte ``first``,
    and the item size; ``ValueError`` naming ``field`` if ``dtype`` is not as wide as its layout
    dtype."""
    itemsize = dtype.itemsize
    if itemsize != _itemsize(field.dtype):
        raise ValueError(
            f"field {field.name!r}: {dtype} is not as wide as its layout dtype {field.dtype}; "
            "override a field only with a dtype of the same width (bfloat16 over uint16)"
        )
    return flat.view(dtype), first // itemsize, itemsize


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides (in items) of ``shape``."""
    strides = [1] * len(shape)
    for axis in range(len(shape) - 1, 0, -1):
        strides[axis - 1] = strides[axis] * shape[axis]
    return tuple(strides)


@lru_cache(maxsize=64)
def _itemsize(numpy_name: str) -> int:
    return np.dtype(numpy_name).itemsize


@lru_cache(maxsize=64)
def torch_dtype(numpy_name: str) -> torch.dtype:
    """The torch dtype with the layout of numpy dtype ``numpy_name``."""
    return torch.from_numpy(np.empty(0, dtype=numpy_name)).dtype
