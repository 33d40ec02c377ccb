"""A packed micro-batch as a list of byte copies into its slot, and the loop that runs them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from knitkit.storage.backends.backend import UnitNeed
from knitkit.types import MicroBatchLayout, UnitKey

Copy = tuple[int, int, int, int]
"""``(source, source byte offset, slot byte offset, bytes)``. Sources ``0 .. len(units) - 1``
are the micro-batch's units (bytes from the unit's start); the negative ones are the constant
sources ``ZEROS``, ``ONES``, ``RAMP`` and ``CONSTANTS`` (``sources``)."""
ZEROS, ONES, RAMP, CONSTANTS = -4, -3, -2, -1
"""Constant sources: zero bytes (alignment and padding rows), float32 ones (a generated loss
mask's real rows), int64 ``0, 1, 2, ...`` (position ids), this micro-batch's own constants
(its ``cu_seqlens`` and ``cu_seqlens_padded``)."""


@dataclass(slots=True)
class MicroBatchCopies:
    """One micro-batch, compiled: its layout and record, the units it reads and the byte copies
    that fill its slot completely (NOTE [ Copy lists ] in delivery/reorganizer.py)."""

    layout: MicroBatchLayout
    record: bytes
    """``layout``'s ``layout_codec`` record."""
    units: Sequence[UnitKey]
    needs: Sequence[UnitNeed]
    """What each of ``units`` must be (checked before its bytes are read)."""
    copies: Sequence[Copy]
    constants: bytes
    unit_bytes: int
    """Bytes the copies read from units (the read counters' figure)."""


def sources(units: list[memoryview], constants: bytes) -> list[memoryview]:
    """The copy sources of a micro-batch: the bytes of its ``units`` (in order, extended in
    place) followed by the constant sources (``reserve``d long enough when it was compiled)."""
    units.extend(_CONSTANTS)
    units.append(memoryview(constants))
    return units


def run_copies(copies: Iterable[Copy], sources: list[memoryview], slot: memoryview) -> None:
    """Every copy of a copy list, in order, between flat byte views (a slice assignment each:
    one memmove; a memoryview's slicing costs half a numpy array's)."""
    for source, at, to, size in copies:
        slot[to : to + size] = sources[source][at : at + size]


def reserve(source: int, nbytes: int) -> None:
    """Make constant source ``ZEROS``, ``ONES`` or ``RAMP`` at least ``nbytes`` long (a
    process-wide cache that only grows, so a copy list compiled earlier stays in bounds)."""
    index = source - ZEROS
    have = len(_CONSTANTS[index])
    if have >= nbytes:
        return
    array = _MAKERS[index](max(nbytes, 2 * have, 1 << 16))
    array.flags.writeable = False
    _CONSTANTS[index] = array.data.cast("B")


_MAKERS: tuple[Callable[[int], np.ndarray], ...] = (
    lambda nbytes: np.zeros(nbytes, np.uint8),
    lambda nbytes: np.ones(-(-nbytes // 4), np.float32),
    lambda nbytes: np.arange(-(-nbytes // 8), dtype=np.int64),
)
"""Each constant source's bytes, at least ``nbytes`` long (in source order)."""
_CONSTANTS: list[memoryview] = [memoryview(b"")] * 3
"""The constant sources in source order (``ZEROS``, ``ONES``, ``RAMP``)."""
