"""Types shared by every part of knitkit: trajectory metadata, atomic-unit keys, packed micro-batches.

This is the only module the four parts (admission, storage, microbatch_iter, encoder_dedup)
import from one another. Keep it small: add a type here only when two parts exchange it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

SeqRange = tuple[int, int]
"""Half-open ``[start, stop)`` range along a field's sequence (first) axis."""


@dataclass(frozen=True, slots=True, order=True)
class UnitKey:
    """Address of one atomic unit: one trajectory's field, or one content-addressed multimodal input."""

    owner: str
    """Trajectory id for per-trajectory fields; content hash for multimodal inputs."""
    field: str
    """Field name ("tokens", "logprobs", "routing", ...) or the multimodal kind ("image", "video")."""

    def __str__(self) -> str:
        return f"{self.owner}/{self.field}"

    @classmethod
    def parse(cls, text: str) -> UnitKey:
        """Inverse of ``str(key)``; the owner may not contain '/', the field may."""
        owner, sep, name = text.partition("/")
        if not sep or not owner or not name:
            raise ValueError(f"not a unit key: {text!r}; expected 'owner/field'")
        return cls(owner, name)


@dataclass(frozen=True, slots=True)
class MultimodalRef:
    """One multimodal input of a trajectory: its unit key and where its features enter the sequence."""

    key: UnitKey
    """Content-addressed key; the n trajectories of a GRPO sample share it."""
    token_start: int
    """Position of the input's first placeholder token in the trajectory."""
    num_tokens: int
    """Number of placeholder tokens (= encoder output rows) the input occupies."""
    cost: float = 0.0
    """Encoder cost estimate used to balance encoder work (e.g. number of patches)."""


@dataclass(frozen=True, slots=True)
class TrajectoryMeta:
    """What admission and planning know about one completed trajectory, without its payload."""

    trajectory_id: str
    sample_id: str
    """The prompt (GRPO group) this trajectory was rolled out from."""
    source: str
    """Data source (dataset / task family) that quotas count."""
    rollout_step: int
    """Rollout step in which the sample was issued."""
    num_tokens: int
    min_version: int
    """Oldest policy version that generated any of its tokens."""
    max_version: int
    """Newest policy version that generated any of its tokens."""
    accepted: bool = True
    """False for trajectories filtered out (e.g. zero-advantage groups): counted, never trained on."""
    multimodal: tuple[MultimodalRef, ...] = ()

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"trajectory {self.trajectory_id!r}: num_tokens={self.num_tokens} < 0")
        if self.min_version > self.max_version:
            raise ValueError(
                f"trajectory {self.trajectory_id!r}: min_version={self.min_version} "
                f"> max_version={self.max_version}"
            )


@dataclass(frozen=True, slots=True)
class UnitRead:
    """A read of one unit, optionally restricted to sequence ranges (``None`` reads it whole)
    and, for a unit of 2 or more dimensions, to a contiguous range of axis 1 (``columns``: a
    pipeline stage's layers of ``[tokens, layers, ...]``; ``None`` reads every column)."""

    key: UnitKey
    ranges: tuple[SeqRange, ...] | None = None
    columns: SeqRange | None = None


@dataclass(frozen=True, slots=True)
class FieldView:
    """Where one field of a packed micro-batch lies inside its flat byte buffer."""

    name: str
    dtype: str
    """numpy dtype name, e.g. "int32", "float32", "bfloat16" is stored as "uint16"."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset from the start of the buffer; a multiple of ``LAYOUT_ALIGNMENT``."""

    @property
    def nbytes(self) -> int:
        return _dtype_info(self.dtype)[1] * math.prod(self.shape)


@lru_cache(maxsize=256)
def _dtype_info(dtype: str | np.dtype) -> tuple[str, int]:
    """Canonical numpy name and item size of ``dtype``, cached: ``np.dtype(x).name`` runs Python
    code (microseconds) and layouts ask for it per field of every micro-batch."""
    resolved = np.dtype(dtype)
    return resolved.name, resolved.itemsize


LAYOUT_ALIGNMENT = 64
"""Byte alignment of every field in a packed micro-batch buffer."""


@dataclass(frozen=True, slots=True)
class MicroBatchLayout:
    """Layout of one packed (THD) micro-batch: named fields as views of one flat byte buffer.

    One flat buffer plus this layout lets every hop (shared memory, pinned memory, device)
    move a micro-batch with a single copy and rebuild the field views afterwards. A backbone
    micro-batch lists its sequences (``trajectory_ids``, ``cu_seqlens_padded``); an encoder
    micro-batch lists the multimodal units it carries (``units``, built by ``of_units``).
    """

    fields: tuple[FieldView, ...]
    nbytes: int
    cu_seqlens_padded: tuple[int, ...] = ()
    """Cumulative PADDED whole-sequence lengths of the packed sequences, starting at 0 (the
    buffer's ``cu_seqlens_padded`` field; its ``cu_seqlens`` field holds the unpadded ones)."""
    trajectory_ids: tuple[str, ...] = ()
    """The packed sequences' trajectories, in packing order."""
    units: tuple[UnitKey, ...] = ()
    """The atomic units carried whole, one field each, in field order (encoder micro-batches)."""
    extra: Mapping[str, int | float | str] = field(default_factory=dict)
    """Small scalars that travel with the micro-batch (mini-batch index, micro-batch index, ...)."""

    @classmethod
    def build(
        cls,
        specs: Mapping[str, tuple[str, tuple[int, ...]]],
        *,
        cu_seqlens_padded: tuple[int, ...] = (),
        trajectory_ids: tuple[str, ...] = (),
        extra: Mapping[str, int | float | str] | None = None,
    ) -> MicroBatchLayout:
        """Lay out ``{name: (dtype, shape)}`` back to back with ``LAYOUT_ALIGNMENT``-aligned offsets."""
        views, nbytes = _lay_out(specs)
        return cls(views, nbytes, cu_seqlens_padded, trajectory_ids, (), dict(extra or {}))

    @classmethod
    def of_units(
        cls,
        specs: Mapping[UnitKey, tuple[str, tuple[int, ...]]],
        *,
        extra: Mapping[str, int | float | str] | None = None,
    ) -> MicroBatchLayout:
        """Lay out whole units ``{key: (dtype, shape)}``, one field each; ``unit_views`` reads them."""
        views, nbytes = _lay_out({str(key): spec for key, spec in specs.items()})
        return cls(views, nbytes, units=tuple(specs), extra=dict(extra or {}))

    def field(self, name: str) -> FieldView:
        for view in self.fields:
            if view.name == name:
                return view
        raise KeyError(
            f"micro-batch has no field {name!r}; fields: {[v.name for v in self.fields]}"
        )

    def numpy_views(self, buffer: Buffer) -> dict[str, np.ndarray]:
        """Zero-copy numpy views of every field over ``buffer`` (at least ``nbytes`` long)."""
        flat = self._flat(buffer)
        # np.ndarray over the flat buffer: one call per field (a slice, view and reshape cost
        # twice as much, and a consumer builds these per micro-batch); bounds are checked above
        # for the layout and by numpy per field
        return {v.name: np.ndarray(v.shape, v.dtype, flat, v.offset) for v in self.fields}

    def clear_padding(self, buffer: Buffer) -> None:
        """Zero the alignment bytes after each field in ``buffer``: a packed micro-batch is then
        a function of its contents alone, whatever a reused buffer (a ring slot) held before."""
        flat = self._flat(buffer)
        for view in self.fields:
            end = view.offset + view.nbytes
            flat[end : view.offset + _align(view.nbytes)] = 0

    def _flat(self, buffer: Buffer) -> np.ndarray:
        """``buffer`` as flat bytes, checked to hold the layout."""
        flat = (
            np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer
        )
        flat = flat.reshape(-1).view(np.uint8)
        if flat.nbytes < self.nbytes:
            raise ValueError(f"buffer has {flat.nbytes} bytes; layout needs {self.nbytes}")
        return flat

    def unit_views(self, buffer: Buffer) -> dict[UnitKey, np.ndarray]:
        """Zero-copy views of the units of an ``of_units`` layout, by unit key."""
        if len(self.units) != len(self.fields):
            raise ValueError(
                f"layout carries {len(self.units)} units but {len(self.fields)} fields; "
                "unit_views reads layouts built with MicroBatchLayout.of_units"
            )
        views = self.numpy_views(buffer)
        return {key: views[view.name] for key, view in zip(self.units, self.fields, strict=True)}


Buffer: TypeAlias = memoryview | bytes | bytearray | np.ndarray
"""A flat byte buffer holding a packed micro-batch (e.g. a view of a shared-memory slot)."""


@dataclass(slots=True)
class PackedMicroBatch:
    """A lease on a packed micro-batch: its layout and the flat buffer it describes.

    Whoever holds a lease owns it and releases it exactly once, when done with the buffer
    (``release()``, or leaving ``with lease:``): ``on_release`` hands the buffer back to its
    producer (a ring slot), so its views must not be used afterwards. Handing a lease on hands
    the ownership on: a ``MicroBatchIterator`` owns every lease it pulls from its source and
    releases each once the training loop moved past it (or once it copied it).
    """

    layout: MicroBatchLayout
    buffer: Buffer
    """The bytes, read-only where the producer shares them with other readers (TP peers)."""
    on_release: Callable[[], None] | None = field(default=None, repr=False)
    seq: int = 0
    """Position in the stream it was published to (a slot ring's sequence number)."""
    private: Callable[[], Buffer] | None = field(default=None, repr=False)
    """If set, gives the same bytes as a writable copy-on-write view private to this process
    (valid until the release): a CPU ``MicroBatchIterator`` hands its tensors out over it, so an
    in-place write stays with this rank instead of changing the peers' micro-batch."""
    released: bool = field(default=False, init=False)

    @property
    def fields(self) -> dict[str, np.ndarray]:
        """Zero-copy views of every field over ``buffer``."""
        return self.layout.numpy_views(self.buffer)

    def release(self) -> None:
        """Hand the buffer back; the second and later calls do nothing."""
        if not self.released:
            self.released = True
            if self.on_release is not None:
                self.on_release()

    def __enter__(self) -> PackedMicroBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lay_out(
    specs: Mapping[str, tuple[str, tuple[int, ...]]],
) -> tuple[tuple[FieldView, ...], int]:
    """Field views of ``{name: (dtype, shape)}`` back to back, and the total aligned size."""
    views: list[FieldView] = []
    offset = 0
    for name, (dtype, shape) in specs.items():
        dtype_name, itemsize = _dtype_info(dtype)
        dims = tuple(map(int, shape))
        views.append(FieldView(name, dtype_name, dims, offset))
        offset += _align(itemsize * math.prod(dims))
    return tuple(views), offset


def _align(nbytes: int) -> int:
    return (nbytes + LAYOUT_ALIGNMENT - 1) // LAYOUT_ALIGNMENT * LAYOUT_ALIGNMENT


@cache
def slot_setters(cls: type[DataclassInstance]) -> tuple[Callable[[Any, Any], None], ...]:
    """The slot setters of the slotted dataclass ``cls``, in field order: a hot path that makes
    instances without their ``__init__`` (a frozen dataclass's sets each field through
    ``object.__setattr__``) sets their slots with them directly, in storage and in the iterator."""
    return tuple(getattr(cls, f.name).__set__ for f in fields(cls))
