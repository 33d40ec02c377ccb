"""What the iterator yields: a micro-batch as named tensors over one staged buffer, with its stats."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np
import torch

from knitkit.types import LAYOUT_ALIGNMENT, FieldView, MicroBatchLayout, slot_setters


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


class Staged(Protocol):
    """What ``build_micro_batch`` reads of a staged micro-batch (``worker.Staged``)."""

    index: int
    layout: MicroBatchLayout
    flat: torch.Tensor
    tensors: Mapping[str, torch.Tensor]
    fetch_s: float
    stage_s: float


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
        self.handed(mb, mb.wait_s)

    def record(self, staged: Staged, wait_s: float) -> MicroBatchStats:
        """``staged``'s stats, handed over after a wait of ``wait_s``, added to the totals and
        returned (NOTE [ Hand-out objects without __init__ ])."""
        stats = build_micro_batch(staged, wait_s).stats
        self.add(stats)
        return stats

    def handed(self, stats: MicroBatchStats, wait_s: float) -> None:
        """``stats``, handed over after a wait of ``wait_s``, added to the totals with it (set
        here: the prefetch thread builds them before it is known; NOTE [ Micro-batches built
        ahead ] in worker.py)."""
        _SET_WAIT_S(stats, wait_s)
        if self.count == 0:
            self.first_wait_s = wait_s
        self.count += 1
        self.wait_s += wait_s
        self.fetch_s += stats.fetch_s
        self.stage_s += stats.stage_s
        self.nbytes += stats.nbytes

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
    what must live longer or be modified. A slot that carries the same layout again hands out
    the same tensor objects over its new bytes (NOTE [ Reused field views ]).
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


# NOTE [ Hand-out objects without __init__ ]: a frozen dataclass's ``__init__`` sets each field
# through ``object.__setattr__``: 5.3 us for a 9-field one against 0.8 us unfrozen (timeit, 2-core
# dev box at load ~8, issue 31), paid per micro-batch for the iterator's ``MicroBatchStats`` and
# ``MicroBatch`` (and a consumer's ``MicroBatchLayout``, layout_codec.py). These stay frozen for
# their users and are built here by their slot setters, both in one frame
# (``build_micro_batch``): the same objects, equal to the constructors'
# (tests/storage/test_handout_calls.py).
_STATS_SLOTS = slot_setters(MicroBatchStats)
_SET_WAIT_S = _STATS_SLOTS[1]  # index, wait_s, fetch_s, stage_s, nbytes
_BATCH_SLOTS = slot_setters(MicroBatch)


def build_micro_batch(staged: Staged, wait_s: float) -> MicroBatch:
    """``staged``'s ``MicroBatch`` with its ``MicroBatchStats`` (waited ``wait_s``), both built
    in one frame without their ``__init__`` (NOTE [ Hand-out objects without __init__ ])."""
    stats = _new(MicroBatchStats)
    numbers = (staged.index, wait_s, staged.fetch_s, staged.stage_s, staged.layout.nbytes)
    for set_slot, number in zip(_STATS_SLOTS, numbers, strict=True):
        set_slot(stats, number)
    batch = _new(MicroBatch)
    values = (staged.index, staged.layout, staged.flat, staged.tensors, stats)
    for set_slot, value in zip(_BATCH_SLOTS, values, strict=True):
        set_slot(batch, value)
    return batch


_new = object.__new__


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
    _check_flat(flat, layout.nbytes)
    return _views(_Typed(flat), layout, overrides)


def _check_flat(flat: torch.Tensor, nbytes: int) -> None:
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < nbytes:
        raise ValueError(
            f"field views need a flat uint8 tensor of at least {nbytes} bytes; got "
            f"{flat.dtype} of shape {tuple(flat.shape)}"
        )


class _Typed(dict[torch.dtype, tuple[torch.Tensor, int, int]]):
    """A flat uint8 tensor viewed as items of each dtype asked for: ``(view, element offset of
    the flat tensor's first byte, item size)``, made once per dtype (and kept with a
    ``ViewCache`` for every layout built over the same buffer). Made again once autograd
    reached a dtype view (an in-place op on a field view with grad rebases its history onto the
    view it was cut from): views cut from it would require grad."""

    __slots__ = ("address", "first", "flat", "numel", "source", "views")

    def __init__(self, flat: torch.Tensor) -> None:
        super().__init__()
        self.source = flat
        """The tensor given: a ``ViewCache`` handed the same object again skips the checks by
        address (NOTE [ One torch entry point per view ])."""
        self.address = flat.data_ptr()
        self.numel = numel = flat.numel()
        """The buffer's bytes (``flat`` may be shorter: whole items of the widest dtype)."""
        if numel % LAYOUT_ALIGNMENT:  # a view as a wider dtype needs whole items
            flat = flat[: numel - numel % LAYOUT_ALIGNMENT]
        self.flat = flat
        self.first = int(flat.storage_offset())
        self.views: list[torch.Tensor] = []

    def __missing__(self, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
        view = self.flat.view(dtype)
        self.views.append(view)
        typed = self[dtype] = (view, self.first // dtype.itemsize, dtype.itemsize)
        return typed


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


_UNIT_STRIDE = (1,)


class _Strides(dict[tuple[int, ...], tuple[int, ...]]):
    """Row-major strides (in items) of any shape, by its dimensions after the first (the first
    varies per micro-batch, the others mostly do not): a subscript per field."""

    def __missing__(self, trailing: tuple[int, ...]) -> tuple[int, ...]:
        if len(self) >= 256:  # bounded: a source whose trailing dimensions keep changing
            self.clear()
        strides = self[trailing] = _contiguous((1, *trailing))
        return strides


_STRIDES = _Strides()


def _views(
    typed: _Typed, layout: MicroBatchLayout, overrides: Mapping[str, torch.dtype] | None
) -> dict[str, torch.Tensor]:
    """Every field of ``layout`` as an ``as_strided`` view of ``typed``'s view of its dtype."""
    views = {}
    for view in layout.fields:
        dtype = overrides.get(view.name) if overrides else None
        if dtype is None:
            dtype = _TORCH_DTYPES[view.dtype]
        elif dtype.itemsize != _itemsize(view.dtype):
            raise ValueError(
                f"field {view.name!r}: {dtype} is not as wide as its layout dtype {view.dtype}; "
                "override a field only with a dtype of the same width (bfloat16 over uint16)"
            )
        tensor, start, itemsize = typed[dtype]
        shape = view.shape
        strides = _STRIDES[shape[1:]] if shape else ()
        views[view.name] = tensor.as_strided(shape, strides, start + view.offset // itemsize)
    return views


# NOTE [ Reused field views ]
# Building a micro-batch's field views costs one torch call per field and one per dtype
# (``field_tensors``: ~8 us for prefetch.py's 3 fields, ~30 us for 9 on the 2-core dev box), and
# each call drops and retakes the GIL: with the training loop's thread running torch ops, every
# such hand-off lets the loop in and makes the prefetch thread wait for the GIL again, so a
# micro-batch can be late although the thread had the time to stage it. A staging slot (or a
# ring slot's private view) mostly carries the same layout again, so its views are built once
# and handed out again (with the credits in a SimpleQueue, NOTE [ Prefetch thread shutdown ] in
# worker.py: prefetch.py at X6/Y4, load 4-7, the loop's steady wait per micro-batch went from
# 265-850 us, p90 0.9-2.1 ms, to 41-61 us, p90 61-75 us; issue 31) while
# - the layout is the one they were built for (its fields tuple, or an equal one, its size, the
#   same dtype overrides), over the same buffer (a slot that grows drops them: StagingRing.ensure);
# - the training loop left them as built: shape, requires_grad, strides and data pointer of the
#   flat tensor and of every field view are compared with their values at build time (C-level
#   maps, no torch call, no GIL hand-off), so a loop that reshaped one in place (``unsqueeze_``),
#   made it require grad, gave it autograd history or swapped its ``.data`` gets fresh views.
# Each micro-batch gets its own dict of them (a loop that adds or pops keys changes only its own).
# What the loop writes into the bytes is covered by the lifetime rule (valid until the next
# next(); NOTE [ Zero-copy hand-off ] in worker.py).
# Where every micro-batch has a layout of its own (packed token counts vary: transfer.py's), the
# views are built per micro-batch, so that build is kept to the torch call per field: the
# buffer's view per dtype is made once per buffer and kept (``_Typed``), and no snapshot is
# taken at build time: the views' state at build is a function of the layout and the buffer's
# address (shapes and contiguous strides from the layout, not requiring grad, data pointers at
# the fields' offsets), computed once the layout comes back. 9 fields of transfer.py's shapes, a
# new layout each time (thread time, 2-core dev box, scratch measurement, issue 31): 23 -> 13 us
# per micro-batch.

# NOTE [ One torch entry point per view ]: right after compute a hand-out runs with cold caches,
# where each torch entry point it calls costs its dispatch code fetched again once, and each
# further call of the same one little: 9 ``as_strided`` cost 76 us there, one tensor slice
# (``base[:n]``, torch's Python indexing) 99 us alone (thread time after a cache-thrashing
# compute stand-in, medians of 200, load 14-16, issue 31). So ``ViewCache.put`` cuts the flat
# tensor with ``as_strided`` like every field view, and a buffer handed in again as the same
# tensor object (a ring slot's kept tensor, a staging slot) is not asked its address and size
# again (knitkit never resizes those in place; a staging slot that grows is a new tensor and
# clears its cache): ``numel``, ``data_ptr`` and a slice, then 9 views, 100-158 us; 10 views
# 80-134 us (3 interleaved runs, load 18). A new shape's hand-out then calls two torch entry
# points, ``as_strided`` and the ``requires_grad`` check (tests/storage/test_handout_calls.py).

_SHAPE_AND_GRAD = operator.attrgetter("shape", "requires_grad")


class ViewCache:
    """Field views of one flat buffer, built for the last layout and handed out again while
    that layout repeats and the loop left them as built (NOTE [ Reused field views ])."""

    __slots__ = (
        "_built",
        "_fields",
        "_flat",
        "_nbytes",
        "_overrides",
        "_tensors",
        "_typed",
        "_viewed",
    )

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the views (the buffer they view is going away)."""
        self._fields: tuple[FieldView, ...] = ()
        self._nbytes = -1
        self._overrides: Mapping[str, torch.dtype] = {}
        self._flat: torch.Tensor | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._viewed: tuple[torch.Tensor, ...] = ()
        self._built: tuple[list[object], ...] | None = None
        """The views' state at build time, once a ``get`` asked for it (``_as_built``)."""
        self._typed: _Typed | None = None

    def get(
        self, layout: MicroBatchLayout, overrides: Mapping[str, torch.dtype]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """The flat tensor and a fresh dict of the cached field views, or None if ``layout``
        (with ``overrides``) is not the one they were built for or the loop changed one."""
        if (
            self._flat is None
            or layout.nbytes != self._nbytes  # first: it tells most new layouts apart at once
            or overrides != self._overrides
        ):
            return None
        fields = layout.fields
        if fields is not self._fields:
            if fields != self._fields:
                return None
            # an equal tuple (decoded again): the next one is likely this very tuple (NOTE
            # [ Shapes decoded once ] in knitkit/storage/delivery/layout_codec.py)
            self._fields = fields
        if self._built is None:
            assert self._typed is not None
            self._built = _as_built(self._typed.address, layout)
        if _snapshot(self._viewed) != self._built:
            return None
        return self._flat, dict(self._tensors)

    def put(
        self, base: torch.Tensor, layout: MicroBatchLayout, overrides: Mapping[str, torch.dtype]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Build ``base[:layout.nbytes]`` and its field views, cache them, return them as ``get``.
        ``base`` views the same buffer at every call (a slot, or its ring slot's private view;
        it may be as long as the micro-batch only)."""
        nbytes = layout.nbytes
        typed = self._typed
        if typed is None or any(map(_REQUIRES_GRAD, typed.views)):  # autograd: see ``_Typed``
            _check_flat(base, nbytes)
            typed = self._typed = _Typed(base)
        elif base is not typed.source:  # another tensor object: the buffer by its address
            numel = base.numel()
            if base.data_ptr() != typed.address or numel > typed.numel:
                _check_flat(base, nbytes)
                typed = self._typed = _Typed(base)
            elif numel < nbytes:
                _check_flat(base, nbytes)
        elif typed.numel < nbytes:
            _check_flat(base, nbytes)
        # the flat tensor too is an ``as_strided`` view (NOTE [ One torch entry point per view ])
        offset = typed.first if base is typed.source else base.storage_offset()
        flat = base.as_strided((nbytes,), _UNIT_STRIDE, offset)
        tensors = _views(typed, layout, overrides)
        self._fields, self._nbytes, self._overrides = layout.fields, layout.nbytes, dict(overrides)
        self._flat, self._tensors = flat, tensors
        self._viewed = (flat, *tensors.values())
        self._built = None
        return flat, dict(tensors)


def _snapshot(tensors: tuple[torch.Tensor, ...]) -> tuple[list[object], ...]:
    """What the loop could change in place on a view: compared before it is handed out again."""
    return (
        list(map(_SHAPE_AND_GRAD, tensors)),
        list(map(torch.Tensor.stride, tensors)),
        list(map(torch.Tensor.data_ptr, tensors)),
    )


def _as_built(address: int, layout: MicroBatchLayout) -> tuple[list[object], ...]:
    """``_snapshot`` of ``layout``'s flat tensor and field views as ``ViewCache.put`` builds
    them over a buffer at ``address``."""
    fields = layout.fields
    return (
        [((layout.nbytes,), False), *((view.shape, False) for view in fields)],
        [_UNIT_STRIDE, *(_contiguous(view.shape) for view in fields)],
        [address, *(address + view.offset for view in fields)],
    )


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


class _DtypeNames(dict[str, torch.dtype]):
    """``torch_dtype``'s answers as a dict filled on first use: a subscript per field costs less
    than a call."""

    def __missing__(self, numpy_name: str) -> torch.dtype:
        dtype = self[numpy_name] = torch_dtype(numpy_name)
        return dtype


_TORCH_DTYPES = _DtypeNames()
