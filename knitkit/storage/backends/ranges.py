"""Range checks and destination buffers shared by every ``UnitBackend`` (one place for the contract's errors)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from knitkit.storage.backends.backend import UnitSpec
from knitkit.types import SeqRange, UnitKey, UnitRead


def check_ranges(
    key: UnitKey, spec: UnitSpec, ranges: Sequence[SeqRange] | None
) -> tuple[SeqRange, ...] | None:
    """Validate ``ranges`` against the unit's sequence axis; ``None`` means the whole unit.

    Raises ``IndexError`` naming the key for a range outside ``[0, shape[0]]``, a reversed
    range, ranges that overlap (they would duplicate rows), or any range on a 0-d (scalar) unit;
    ``TypeError`` for bounds that are not integers (``1.5``, ``True``).
    """
    if ranges is None:
        return None
    if not spec.shape:
        raise IndexError(f"unit {key} is a scalar; read it whole (ranges=None), not {list(ranges)}")
    length = spec.shape[0]
    out = []
    in_order = True
    stop_before = 0
    for start, stop in ranges:
        # `type(...) is int` first: the common case costs no isinstance checks (NOT bool)
        start = start if type(start) is int else _bound(key, start)
        stop = stop if type(stop) is int else _bound(key, stop)
        if not 0 <= start <= stop <= length:
            raise IndexError(
                f"range [{start}, {stop}) is outside unit {key} of length {length}; "
                "ranges must satisfy 0 <= start <= stop <= length"
            )
        if start < stop:
            in_order = in_order and start >= stop_before
            stop_before = stop
        out.append((start, stop))
    if not in_order:  # rare: ranges out of order, or overlapping; sort to tell which
        spans = sorted(r for r in out if r[0] < r[1])
        for (a, b), (c, d) in itertools.pairwise(spans):
            if c < b:
                raise IndexError(
                    f"ranges [{a}, {b}) and [{c}, {d}) of unit {key} overlap; "
                    "each row may be read once per read"
                )
    return tuple(out)


def meets_need(spec: UnitSpec, need: tuple[str, tuple[int, ...], int]) -> bool:
    """Whether ``spec`` is what a copy list reads it as (``planning.copy_list.UnitNeed``: dtype,
    row shape, rows read up to, or the whole unit of that shape); ``check_need`` raises when not."""
    dtype, row, rows = need
    shape = spec.shape
    if rows < 0:
        return spec.dtype == dtype and shape == row
    return spec.dtype == dtype and bool(shape) and shape[1:] == row and shape[0] >= rows


def check_need(key: UnitKey, spec: UnitSpec, need: tuple[str, tuple[int, ...], int]) -> None:
    """``meets_need``, else the error ``read`` would raise for it: ``ValueError`` for a dtype or
    row shape the plan does not pack it as, ``IndexError`` for rows past its end; both name the
    key."""
    if meets_need(spec, need):
        return
    dtype, row, rows = need
    if rows < 0:
        raise ValueError(
            f"unit {key} is {spec.dtype}{list(spec.shape)}; the plan reads it whole as "
            f"{dtype}{list(row)}: register the plan with the store's schema"
        )
    if spec.dtype != dtype or spec.shape[1:] != row or not spec.shape:
        raise ValueError(
            f"unit {key} is {spec.dtype}{list(spec.shape)}; the plan reads rows of {dtype}"
            f"{list(row)} from it: register the plan with the store's schema"
        )
    raise IndexError(
        f"rows up to {rows} are outside unit {key} of length {spec.shape[0]}; the plan's "
        "lengths must match the stored units"
    )


def check_columns(key: UnitKey, spec: UnitSpec, columns: SeqRange | None) -> SeqRange | None:
    """Validate a column range (``UnitRead.columns``: a contiguous range of axis 1); ``None``
    means every column. ``IndexError`` naming the key for a unit without axis 1 or a range
    outside ``[0, shape[1]]``; ``TypeError`` for bounds that are not integers."""
    if columns is None:
        return None
    if len(spec.shape) < 2:
        raise IndexError(
            f"unit {key} of shape {list(spec.shape)} has no axis 1 to take columns "
            f"{list(columns)} of; read it without columns"
        )
    start, stop = (c if type(c) is int else _bound(key, c) for c in columns)
    if not 0 <= start <= stop <= spec.shape[1]:
        raise IndexError(
            f"columns [{start}, {stop}) are outside axis 1 of unit {key} (size {spec.shape[1]}); "
            "columns must satisfy 0 <= start <= stop <= shape[1]"
        )
    return (start, stop)


def _bound(key: UnitKey, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"range bound {value!r} of unit {key} is not an integer")
    return int(value)


def rows_of(spec: UnitSpec, ranges: tuple[SeqRange, ...] | None) -> int:
    """Rows along axis 0 that a read of ``ranges`` returns (1 for a whole scalar unit)."""
    if ranges is None:
        return spec.shape[0] if spec.shape else 1
    return sum(stop - start for start, stop in ranges)


def destination(
    key: UnitKey,
    spec: UnitSpec,
    ranges: tuple[SeqRange, ...] | None,
    out: np.ndarray | None,
    columns: SeqRange | None = None,
) -> np.ndarray:
    """The array a read fills: ``out`` after checking it, or a fresh one of the right shape
    (``columns``, checked: only that range of axis 1)."""
    shape = spec.shape if ranges is None else (rows_of(spec, ranges), *spec.shape[1:])
    if columns is not None:
        shape = (shape[0], columns[1] - columns[0], *shape[2:])
    if out is None:
        return np.empty(shape, dtype=spec.dtype)
    if out.dtype != np.dtype(spec.dtype) or out.shape != shape:
        hint = ""
        if out.ndim == len(shape) > 1 and out.shape[0] == shape[0] and out.shape[1] < shape[1]:
            hint = (
                " (a read of a column range, UnitRead.columns, that this read path ignored: "
                "read it with read_many of a backend that reads column ranges, as knitkit's "
                "memory, shared-memory, disk, Ray and Mooncake backends do; UnitBackend's "
                "default read_many and read() do not)"
            )
        raise ValueError(
            f"out for unit {key} is {out.dtype}{list(out.shape)}; the read needs "
            f"{spec.dtype}{list(shape)}{hint}"
        )
    if not out.flags.c_contiguous:
        raise ValueError(f"out for unit {key} must be C-contiguous")
    return out


Fill = Callable[[tuple[SeqRange, ...] | None, np.ndarray], int | None]
"""Copies the checked ranges (``None``: the whole unit) of one unit, in order, into the array;
returns the bytes it moved when that is not the destination's size (a transport that fetches
whole units), else ``None``."""


class ReadCounter:
    """The body every backend's ``read`` shares: check ranges, open the destination, fill, count.

    A backend supplies only how its bytes reach the destination (``fill``); the contract's
    errors (``check_ranges``, ``destination``) and ``bytes_read`` come from here.
    """

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0
        """Payload bytes moved by reads so far."""

    def read(
        self,
        key: UnitKey,
        spec: UnitSpec,
        ranges: Sequence[SeqRange] | None,
        out: np.ndarray | None,
        fill: Fill,
    ) -> np.ndarray:
        checked, dst = self.open(key, spec, ranges, out)
        moved = fill(checked, dst)
        self.bytes += dst.nbytes if moved is None else moved
        return dst

    @staticmethod
    def open(
        key: UnitKey, spec: UnitSpec, ranges: Sequence[SeqRange] | None, out: np.ndarray | None
    ) -> tuple[tuple[SeqRange, ...] | None, np.ndarray]:
        """The checked ranges and the destination of one read (for batched reads that fill many
        destinations at once and add their bytes to ``bytes`` themselves)."""
        checked = check_ranges(key, spec, ranges)
        return checked, destination(key, spec, checked, out)

    def copy_rows(
        self,
        key: UnitKey,
        unit: np.ndarray,
        ranges: Sequence[SeqRange] | None,
        out: np.ndarray | None,
    ) -> np.ndarray:
        """A read of a unit already in (local or shared) memory."""
        return self.read(key, spec_of(unit), ranges, out, lambda c, dst: copy_ranges(unit, c, dst))


def copy_read(
    unit: UnitRead, spec: UnitSpec, stored: np.ndarray, out: np.ndarray | None
) -> np.ndarray:
    """One ``UnitRead`` of a unit held in (local or shared) memory, ``stored``: its ranges and
    columns checked, copied into ``out`` (or a fresh array), which it returns. A column range
    is a strided copy: the other columns of a row are never read (a pipeline stage's layers of
    ``[tokens, layers, topk]`` routing)."""
    ranges, columns, dst = open_read(unit, spec, out)
    copy_ranges(stored, ranges, dst, columns)
    return dst


def open_read(
    unit: UnitRead, spec: UnitSpec, out: np.ndarray | None
) -> tuple[tuple[SeqRange, ...] | None, SeqRange | None, np.ndarray]:
    """The checked ranges and columns of one ``UnitRead`` and its destination (``out`` checked,
    or a fresh array): the contract's errors, for a backend that fills the destination itself
    (a file, a transport); ``copy_read`` is the whole read of a unit held in memory."""
    ranges = check_ranges(unit.key, spec, unit.ranges)
    columns = check_columns(unit.key, spec, unit.columns)
    return ranges, columns, destination(unit.key, spec, ranges, out, columns)


def copy_ranges(
    unit: np.ndarray,
    ranges: tuple[SeqRange, ...] | None,
    dst: np.ndarray,
    columns: SeqRange | None = None,
) -> None:
    """Copy ``ranges`` of ``unit`` (all of it for ``None``) back to back into ``dst``; only
    ``columns`` of axis 1 when given (checked)."""
    if columns is not None:
        unit = unit[:, columns[0] : columns[1]]
    if ranges is None:
        np.copyto(dst, unit)
        return
    row = 0
    for start, stop in ranges:
        dst[row : row + stop - start] = unit[start:stop]
        row += stop - start


def paste_ranges(unit: np.ndarray, ranges: tuple[SeqRange, ...], values: np.ndarray) -> None:
    """The inverse of ``copy_ranges``: ``values``' rows, back to back, into ``ranges`` of ``unit``."""
    row = 0
    for start, stop in ranges:
        unit[start:stop] = values[row : row + stop - start]
        row += stop - start


def check_write(
    key: UnitKey, spec: UnitSpec, ranges: Sequence[SeqRange], values: np.ndarray
) -> tuple[SeqRange, ...]:
    """Validate a ranged write (``UnitBackend.write_ranges``); returns the checked ranges.

    The ranges obey ``check_ranges`` (in bounds, not overlapping; ``IndexError`` naming the key);
    ``values`` must hold exactly their rows, back to back, with the unit's dtype and row shape
    (``ValueError`` naming the key otherwise: nothing is cast).
    """
    if ranges is None:
        raise TypeError(f"write_ranges of unit {key} needs ranges; use replace() for a whole unit")
    checked = check_ranges(key, spec, ranges)
    assert checked is not None
    shape = (rows_of(spec, checked), *spec.shape[1:])
    if values.dtype != np.dtype(spec.dtype) or tuple(values.shape) != shape:
        raise ValueError(
            f"write_ranges of unit {key}: the ranges need {spec.dtype}{list(shape)}, got "
            f"{values.dtype}{list(values.shape)}"
        )
    return checked


def check_replacement(key: UnitKey, spec: UnitSpec, array: np.ndarray) -> None:
    """``replace`` keeps a unit's dtype and shape; raise ``ValueError`` naming the key otherwise."""
    if np.dtype(spec.dtype) != array.dtype or tuple(spec.shape) != array.shape:
        raise ValueError(
            f"replace of unit {key}: stored {spec.dtype}{list(spec.shape)}, "
            f"got {array.dtype}{list(array.shape)}; delete and put to change dtype or shape"
        )


def spec_of(array: np.ndarray) -> UnitSpec:
    return UnitSpec(array.dtype.name, tuple(int(s) for s in array.shape))
