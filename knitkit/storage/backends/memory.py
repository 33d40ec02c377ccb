"""In-process memory backend: units are private numpy arrays, range reads copy only the rows asked for."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from knitkit.storage.backends.backend import UnitBackend, UnitNeed, UnitSpec, UnitViews
from knitkit.storage.backends.ranges import (
    ReadCounter,
    check_need,
    check_replacement,
    check_write,
    copy_read,
    paste_ranges,
    spec_of,
)
from knitkit.storage.backends.validate import check_unit
from knitkit.types import SeqRange, UnitKey, UnitRead


class MemoryBackend(UnitBackend):
    """``UnitBackend`` over a dict of arrays; pickling copies the units (use it within one process)."""

    def __init__(self) -> None:
        self._units: dict[UnitKey, np.ndarray] = {}
        self._reads = ReadCounter()

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        value = check_unit(key, array)
        if key in self._units:
            raise KeyError(f"unit {key} already exists; use replace() to update it")
        self._units[key] = np.array(value, order="C", copy=True)

    def replace(self, key: UnitKey, array: np.ndarray) -> None:
        check_replacement(key, self.spec(key), array)
        np.copyto(self._units[key], array)

    def write_ranges(self, key: UnitKey, ranges: Sequence[SeqRange], values: np.ndarray) -> None:
        unit = self._unit(key)
        paste_ranges(unit, check_write(key, spec_of(unit), ranges, values), values)

    def spec(self, key: UnitKey) -> UnitSpec:
        return spec_of(self._unit(key))

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        return self._reads.copy_rows(key, self._unit(key), ranges, out)

    def read_many(self, reads: Sequence[UnitRead], outs: Sequence[np.ndarray]) -> None:
        """``read`` for every pair; a read's ``columns`` copy only that range of axis 1."""
        if len(reads) != len(outs):
            raise ValueError(f"read_many got {len(reads)} reads but {len(outs)} outs; pair them")
        for unit, out in zip(reads, outs, strict=True):
            stored = self._unit(unit.key)
            self._reads.bytes += copy_read(unit, spec_of(stored), stored, out).nbytes

    def map_units(self, keys: Sequence[UnitKey], needs: Sequence[UnitNeed]) -> UnitViews:
        """Units resolved per range, when asked (a dict lookup each: nothing to gain ahead)."""
        return _EachTime(self, keys, needs)

    def _unit_bytes(
        self, keys: Sequence[UnitKey], needs: Sequence[UnitNeed], nbytes: int
    ) -> list[memoryview]:
        """Flat byte views of whole units for a copy list to read ``nbytes`` of (counted in
        ``bytes_read``), each checked to be what it reads them as (``check_need``)."""
        out = []
        for key, need in zip(keys, needs, strict=True):
            unit = self._unit(key)
            check_need(key, spec_of(unit), need)
            out.append(unit.reshape(-1).view(np.uint8).data)
        self._reads.bytes += nbytes
        return out

    def view(self, key: UnitKey) -> np.ndarray:
        """Read-only zero-copy view of a whole unit."""
        unit = self._unit(key).view()
        unit.flags.writeable = False
        return unit

    def delete(self, key: UnitKey) -> None:
        self._unit(key)
        del self._units[key]

    def keys(self) -> Iterator[UnitKey]:
        return iter(list(self._units))

    @property
    def bytes_read(self) -> int:
        return self._reads.bytes

    def close(self) -> None:
        self._units.clear()

    def _unit(self, key: UnitKey) -> np.ndarray:
        try:
            return self._units[key]
        except KeyError:
            raise KeyError(
                f"unknown unit {key}; it was never put or was already released"
            ) from None


class _EachTime:
    """``UnitViews`` of a ``MemoryBackend``: each range looked up when asked."""

    __slots__ = ("_backend", "_keys", "_needs")

    def __init__(
        self, backend: MemoryBackend, keys: Sequence[UnitKey], needs: Sequence[UnitNeed]
    ) -> None:
        self._backend, self._keys, self._needs = backend, keys, needs

    def views(self, start: int, stop: int, nbytes: int) -> list[memoryview]:
        return self._backend._unit_bytes(self._keys[start:stop], self._needs[start:stop], nbytes)
