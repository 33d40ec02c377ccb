"""What the iterator accepts from its source, and how one source item becomes one host copy."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias, runtime_checkable

import numpy as np
import torch

from knitkit.types import MicroBatchLayout

Buffer: TypeAlias = memoryview | bytes | bytearray | np.ndarray
"""A flat byte buffer holding a packed micro-batch (e.g. a view of a shared-memory slot)."""


@runtime_checkable
class PackedItem(Protocol):
    """A packed micro-batch: a layout and the flat buffer it describes.

    The item may also have a ``release()`` method: the iterator calls it once its copy of
    ``buffer`` is complete, so the producer (the reorganizer) may reuse the buffer's slot.
    """

    @property
    def layout(self) -> MicroBatchLayout: ...

    @property
    def buffer(self) -> Buffer: ...


FieldArray: TypeAlias = np.ndarray | torch.Tensor
SourceItem: TypeAlias = PackedItem | tuple[MicroBatchLayout, Buffer] | Mapping[str, FieldArray]
"""One item of a source: a packed micro-batch, a ``(layout, buffer)`` pair, or ``{field: array}``."""


@dataclass(frozen=True, slots=True)
class PackedMicroBatch:
    """A ready-made ``PackedItem`` with an optional release callback."""

    layout: MicroBatchLayout
    buffer: Buffer
    on_release: Callable[[], None] | None = None

    def release(self) -> None:
        if self.on_release is not None:
            self.on_release()


@dataclass(frozen=True, slots=True)
class StagingPlan:
    """How to stage one source item: its layout, the arrays to copy to which offsets, its release."""

    layout: MicroBatchLayout
    copies: tuple[tuple[int, np.ndarray], ...]
    """``(byte offset, array)`` pairs; a packed item is one pair covering the whole buffer."""
    torch_dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    """Overrides of the layout's numpy dtypes (bfloat16 travels as "uint16")."""
    release: Callable[[], None] | None = None

    def copy_into(self, dst: np.ndarray) -> None:
        """Copy every array into the flat uint8 buffer ``dst``, one strided copy per array."""
        for offset, array in self.copies:
            target = dst[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)
            np.copyto(target, array, casting="no")


def plan_staging(item: SourceItem) -> StagingPlan:
    """Describe how to copy ``item`` into a flat staging buffer; raises on malformed items."""
    if isinstance(item, PackedItem):
        release = getattr(item, "release", None)
        flat = _flat_bytes(item.buffer, item.layout)
        return StagingPlan(item.layout, ((0, flat),), release=release)
    if isinstance(item, Mapping):
        return _plan_fields(item)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], MicroBatchLayout):
        layout, buffer = item
        return StagingPlan(layout, ((0, _flat_bytes(buffer, layout)),))
    raise TypeError(
        f"source item of type {type(item).__name__} is not a packed micro-batch (.layout and "
        ".buffer), a (layout, buffer) tuple, or a mapping of field name to array; wrap it in "
        "PackedMicroBatch(layout, buffer)"
    )


def _flat_bytes(buffer: Buffer, layout: MicroBatchLayout) -> np.ndarray:
    flat = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, dtype=np.uint8)
    if not flat.flags.c_contiguous:
        raise ValueError("packed micro-batch buffer is not contiguous; pass the flat slot buffer")
    flat = flat.reshape(-1).view(np.uint8)
    if flat.nbytes < layout.nbytes:
        raise ValueError(
            f"packed micro-batch buffer has {flat.nbytes} bytes but its layout needs "
            f"{layout.nbytes}; pass the whole slot the layout was built for"
        )
    return flat[: layout.nbytes]


def _plan_fields(item: Mapping[str, FieldArray]) -> StagingPlan:
    arrays: dict[str, np.ndarray] = {}
    overrides: dict[str, torch.dtype] = {}
    for name, value in item.items():
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise ValueError(
                    f"field {name!r} is on {value.device}; the iterator stages host data, "
                    "so pass CPU tensors or numpy arrays"
                )
            value = value.detach()
            if value.dtype == torch.bfloat16:
                overrides[name] = torch.bfloat16
                value = value.view(torch.uint16)
            arrays[name] = value.numpy()
        else:
            arrays[name] = np.asarray(value)
    layout = MicroBatchLayout.build({n: (a.dtype.name, a.shape) for n, a in arrays.items()})
    copies = tuple((layout.field(n).offset, a) for n, a in arrays.items())
    return StagingPlan(layout, copies, overrides)
