"""Range checks and destination buffers shared by every ``UnitBackend`` (one place for the contract's errors)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from knitkit.storage.backends.backend import UnitSpec
from knitkit.types import SeqRange, UnitKey


def check_ranges(
    key: UnitKey, spec: UnitSpec, ranges: Sequence[SeqRange] | None
) -> tuple[SeqRange, ...] | None:
    """Validate ``ranges`` against the unit's sequence axis; ``None`` means the whole unit.

    Raises ``IndexError`` naming the key for a range outside ``[0, shape[0]]``, a reversed
    range, or any range on a 0-d (scalar) unit.
    """
    if ranges is None:
        return None
    if not spec.shape:
        raise IndexError(f"unit {key} is a scalar; read it whole (ranges=None), not {list(ranges)}")
    length = spec.shape[0]
    out = tuple((int(a), int(b)) for a, b in ranges)
    for start, stop in out:
        if not 0 <= start <= stop <= length:
            raise IndexError(
                f"range [{start}, {stop}) is outside unit {key} of length {length}; "
                "ranges must satisfy 0 <= start <= stop <= length"
            )
    return out


def rows_of(spec: UnitSpec, ranges: tuple[SeqRange, ...] | None) -> int:
    """Rows along axis 0 that a read of ``ranges`` returns (1 for a whole scalar unit)."""
    if ranges is None:
        return spec.shape[0] if spec.shape else 1
    return sum(stop - start for start, stop in ranges)


def destination(
    key: UnitKey, spec: UnitSpec, ranges: tuple[SeqRange, ...] | None, out: np.ndarray | None
) -> np.ndarray:
    """The array a read fills: ``out`` after checking it, or a fresh one of the right shape."""
    shape = spec.shape if ranges is None else (rows_of(spec, ranges), *spec.shape[1:])
    if out is None:
        return np.empty(shape, dtype=spec.dtype)
    if out.dtype != np.dtype(spec.dtype) or out.shape != shape:
        raise ValueError(
            f"out for unit {key} is {out.dtype}{list(out.shape)}; the read needs {spec.dtype}{list(shape)}"
        )
    if not out.flags.c_contiguous:
        raise ValueError(f"out for unit {key} must be C-contiguous")
    return out


def read_ranges(
    key: UnitKey, unit: np.ndarray, ranges: Sequence[SeqRange] | None, out: np.ndarray | None
) -> np.ndarray:
    """A read of an in-memory unit view: the checked ``ranges`` copied, in order, into ``out``
    (or a fresh array); the whole unit when ``ranges`` is ``None``."""
    spec = spec_of(unit)
    checked = check_ranges(key, spec, ranges)
    dst = destination(key, spec, checked, out)
    if checked is None:
        np.copyto(dst, unit)
        return dst
    row = 0
    for start, stop in checked:
        dst[row : row + stop - start] = unit[start:stop]
        row += stop - start
    return dst


def check_replacement(key: UnitKey, spec: UnitSpec, array: np.ndarray) -> None:
    """``replace`` keeps a unit's dtype and shape; raise ``ValueError`` naming the key otherwise."""
    if np.dtype(spec.dtype) != array.dtype or tuple(spec.shape) != array.shape:
        raise ValueError(
            f"replace of unit {key}: stored {spec.dtype}{list(spec.shape)}, "
            f"got {array.dtype}{list(array.shape)}; delete and put to change dtype or shape"
        )


def spec_of(array: np.ndarray) -> UnitSpec:
    return UnitSpec(array.dtype.name, tuple(int(s) for s in array.shape))
