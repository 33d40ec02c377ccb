"""What the iterator accepts from its source, and how one source item becomes one host copy."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol, TypeAlias

import numpy as np
import torch

from knitkit.microbatch_iter.batch import torch_dtype
from knitkit.types import Buffer, FieldView, MicroBatchLayout, PackedMicroBatch


def source_items(source: Iterable[SourceItem]) -> Iterator[SourceItem]:
    """The iterator the prefetch thread pulls from: ``iter(source)``, whatever the source.

    One contract for every source: a ``PackedMicroBatch`` it yields is a lease the iterator now
    owns and releases exactly once; the iterator closes ``iter(source)`` once the thread stopped
    (if it has ``close()``), and calls its ``interrupt()`` (if it has one) from another thread on
    close and at exit, so that a ``next()`` blocked in it returns or raises at once
    (``MicroBatchConsumer`` and its ``take()`` do).
    """
    return iter(source)


class LeasesInline(Protocol):
    """A source iterator whose leases a CPU iterator takes on the training loop's thread, inside
    ``next()``, with no prefetch thread (``MicroBatchConsumer`` and its ``take()``): its
    look-ahead is its producer's, who packs ahead into a ring (NOTE [ Inline hand-out ] in
    worker.py)."""

    def next_lease(self, timeout_s: float) -> PackedMicroBatch:
        """``next()``, waiting at most ``timeout_s`` (then ``TimeoutError``)."""
        ...


def inline_leases(source: Iterator[SourceItem]) -> LeasesInline | None:
    """``source`` if it hands out leases inline (``next_lease``), else None."""
    return source if callable(getattr(source, "next_lease", None)) else None  # type: ignore[return-value]


FieldArray: TypeAlias = np.ndarray | torch.Tensor
SourceItem: TypeAlias = (
    PackedMicroBatch | tuple[MicroBatchLayout, Buffer] | Mapping[str, FieldArray]
)
"""One item of a source: a lease on a packed micro-batch, a ``(layout, buffer)`` pair, or
``{field: array}``."""


@dataclass(frozen=True, slots=True)
class StagingPlan:
    """How to stage one source item: its layout, the arrays to copy to which offsets, its release."""

    layout: MicroBatchLayout
    copies: tuple[tuple[int, np.ndarray], ...]
    """``(byte offset, array)`` pairs; a packed item is one pair covering the whole buffer."""
    torch_dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    """Overrides of the layout's numpy dtypes (bfloat16 travels as "uint16", float8 as "uint8")."""
    release: Callable[[], None] | None = None
    """Releases the item's lease (the iterator owns it: NOTE [ Zero-copy hand-off ])."""
    view: np.ndarray | None = None
    """The whole packed buffer (flat uint8) when its producer keeps it unchanged until
    ``release``: a CUDA iterator may copy it to the device in place (NOTE [ Registered source
    rings ])."""

    def copy_into(self, dst: np.ndarray) -> None:
        """Copy every array into the flat uint8 buffer ``dst``, one strided copy per array, in
        native byte order (the order the layout's dtype names and the device reads)."""
        for offset, array in self.copies:
            native = array.dtype.newbyteorder("=")
            target = dst[offset : offset + array.nbytes].view(native).reshape(array.shape)
            np.copyto(target, array, casting="equiv")


def plan_staging(item: SourceItem) -> StagingPlan:
    """Describe how to copy ``item`` into a flat staging buffer; raises on malformed items."""
    if isinstance(item, PackedMicroBatch):
        check_layout(item.layout)
        flat = _flat_bytes(item.buffer, item.layout)
        view = flat if item.on_release is not None else None
        return StagingPlan(item.layout, ((0, flat),), release=item.release, view=view)
    if isinstance(item, Mapping):
        return _plan_fields(item)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], MicroBatchLayout):
        layout, buffer = item
        check_layout(layout)
        return StagingPlan(layout, ((0, _flat_bytes(buffer, layout)),))
    raise TypeError(
        f"source item of type {type(item).__name__} is not a PackedMicroBatch, a (layout, "
        "buffer) tuple, or a mapping of field name to array; wrap a packed buffer in "
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
            stand_in = _numpy_stand_in(value.dtype)
            if stand_in is not None:
                overrides[name] = value.dtype
                value = value.view(stand_in)
            arrays[name] = value.numpy()
        else:
            arrays[name] = np.asarray(value)
        check_dtype(name, arrays[name].dtype)
    layout = MicroBatchLayout.build({n: (a.dtype.name, a.shape) for n, a in arrays.items()})
    copies = tuple((layout.field(n).offset, a) for n, a in arrays.items())
    return StagingPlan(layout, copies, overrides)


_KINDS = {"U": "str", "S": "bytes", "O": "object", "M": "datetime64", "m": "timedelta64"}


def check_dtype(name: str, dtype: np.dtype) -> None:
    """Raise ``ValueError`` naming field ``name`` unless ``dtype`` can be staged as a tensor."""
    if dtype.kind in "biufc" and dtype.fields is None:
        try:
            torch_dtype(dtype.newbyteorder("=").name)
            return
        except TypeError:
            pass
    kind = "structured" if dtype.fields is not None else _KINDS.get(dtype.kind, "unsupported")
    raise ValueError(
        f"field {name!r} has dtype {dtype} ({kind}), which cannot be staged as a tensor; stage "
        "numbers only (text as token ids, datetimes as int64 epochs) or leave the field out"
    )


_checked: tuple[FieldView, ...] = ()
"""The fields of the last layout that passed ``check_layout``: a source mostly repeats its
layout (often the same object), which then costs one identity test, not a call per field."""


_stageable: set[str] = set()
"""Dtype names of fields that passed ``check_layout``: a layout of these only costs one C call
however many fields it has (a consumer decodes a new layout per micro-batch)."""
_dtype_of = operator.attrgetter("dtype")


def check_layout(layout: MicroBatchLayout) -> None:
    """``ValueError`` naming the first field whose dtype cannot be staged."""
    global _checked
    fields = layout.fields
    if fields is _checked:
        return
    if not _stageable.issuperset(map(_dtype_of, fields)):
        for view in fields:
            _check_field(view.name, view.dtype)
        _stageable.update(map(_dtype_of, fields))
    _checked = fields


@lru_cache(maxsize=256)
def _check_field(name: str, dtype_name: str) -> None:
    """``check_dtype`` by names, cached: every micro-batch repeats its fields (a failure is not
    cached, so it raises every time)."""
    try:
        dtype = np.dtype(dtype_name)
    except TypeError:
        raise ValueError(f"field {name!r} has unknown dtype {dtype_name!r}") from None
    check_dtype(name, dtype)


@lru_cache(maxsize=32)
def _numpy_stand_in(dtype: torch.dtype) -> torch.dtype | None:
    """An unsigned integer dtype of the same width for torch dtypes numpy lacks (bfloat16,
    float8): the bits travel unchanged and the tensor views get ``dtype`` back."""
    try:
        torch.empty(0, dtype=dtype).numpy()
        return None
    except TypeError:
        pass
    width = torch.empty(0, dtype=dtype).element_size()
    stand_ins = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
    if width not in stand_ins:
        raise ValueError(f"torch dtype {dtype} ({width} bytes) cannot be staged")
    return stand_ins[width]
