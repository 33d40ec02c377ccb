"""Node-local shared-memory backend: units live in reused /dev/shm slabs that other processes map."""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from knitkit.storage.backends.backend import UnitSpec
from knitkit.storage.backends.journal import UnitJournal
from knitkit.storage.backends.ranges import (
    check_replacement,
    read_ranges,
    spec_of,
)
from knitkit.storage.backends.slab import Slab, unlink_quietly
from knitkit.types import SeqRange, UnitKey

_Location = tuple[int, int, UnitSpec]
"""(slab index, byte offset, spec) of one unit."""


class SharedMemoryBackend:
    """``UnitBackend`` over /dev/shm slabs; pickle it to hand another process a zero-copy reader.

    The creating process owns the slabs (see NOTE [slab lifetime] in ``slab.py``). A pickled copy
    is a read-only reader attached to the same slabs; it also sees units put after it was pickled
    (see NOTE [unit journal] in ``journal.py``); ``view`` there returns arrays over the shared
    pages, no copy.
    """

    def __init__(self, slab_bytes: int = 256 << 20, directory: str = "/dev/shm") -> None:
        self.slab_bytes = slab_bytes
        self.directory = directory
        self._prefix = f"knitkit-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._slabs: list[Slab] = []
        self._paths: list[str] = []
        self._units: dict[UnitKey, _Location] = {}
        self._owner = True
        self._bytes_read = 0
        self._journal = UnitJournal(os.path.join(directory, f"{self._prefix}-journal"), owner=True)
        self._finalizer = weakref.finalize(self, _unlink_all, self._paths, self._journal.path)

    @property
    def paths(self) -> tuple[str, ...]:
        """The slab files (for tests and leak checks)."""
        return tuple(self._paths)

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        self._require_owner("put")
        if key in self._units:
            raise KeyError(f"unit {key} already exists; use replace() to update it")
        spec = spec_of(array)
        slab_index, offset = self._alloc(spec.nbytes)
        np.copyto(self._slabs[slab_index].array(offset, spec.dtype, spec.shape), array)
        self._units[key] = (slab_index, offset, spec)
        self._journal.append(("put", key, slab_index, offset, spec))

    def replace(self, key: UnitKey, array: np.ndarray) -> None:
        self._require_owner("replace")
        check_replacement(key, self.spec(key), array)
        np.copyto(self._view(key), array)

    def spec(self, key: UnitKey) -> UnitSpec:
        return self._locate(key)[2]

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        dst = read_ranges(key, self._view(key), ranges, out)
        self._bytes_read += dst.nbytes
        return dst

    def view(self, key: UnitKey) -> np.ndarray:
        """Zero-copy view of a whole unit over the shared pages (read-only in readers)."""
        return self._view(key)

    def delete(self, key: UnitKey) -> None:
        self._require_owner("delete")
        slab_index, offset, _ = self._locate(key)
        self._slabs[slab_index].free(offset)
        del self._units[key]
        self._journal.append(("delete", key))

    def keys(self) -> Iterator[UnitKey]:
        return iter(list(self._units))

    @property
    def bytes_read(self) -> int:
        return self._bytes_read

    @property
    def used_bytes(self) -> int:
        return sum(s.used_bytes for s in self._slabs)

    def close(self) -> None:
        for slab in self._slabs:
            slab.close()
        self._slabs.clear()
        self._units.clear()
        self._journal.close()
        if self._owner:
            self._finalizer()

    def __getstate__(self) -> dict[str, Any]:
        sizes = [s.size for s in self._slabs]
        return {
            "paths": list(self._paths),
            "sizes": sizes,
            "units": dict(self._units),
            "journal": self._journal.path,
            "journal_offset": self._journal.size,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._paths = list(state["paths"])
        self._slabs = [
            Slab(p, n, owner=False) for p, n in zip(self._paths, state["sizes"], strict=True)
        ]
        self._units = state["units"]
        self._journal = UnitJournal(state["journal"], owner=False, offset=state["journal_offset"])
        self._owner = False
        self._bytes_read = 0
        self.slab_bytes = 0
        self.directory = os.path.dirname(self._paths[0]) if self._paths else "/dev/shm"

    def _alloc(self, nbytes: int) -> tuple[int, int]:
        for index, slab in enumerate(self._slabs):
            offset = slab.alloc(nbytes)
            if offset is not None:
                return index, offset
        path = os.path.join(self.directory, f"{self._prefix}-{len(self._slabs)}")
        self._paths.append(path)
        self._slabs.append(Slab(path, max(self.slab_bytes, nbytes + 64), owner=True))
        self._journal.append(("slab", path, self._slabs[-1].size))
        offset = self._slabs[-1].alloc(nbytes)
        assert offset is not None
        return len(self._slabs) - 1, offset

    def _locate(self, key: UnitKey) -> _Location:
        if not self._owner:
            self._follow_journal()
        try:
            return self._units[key]
        except KeyError:
            raise KeyError(
                f"unknown unit {key}; it was never put or was already released"
            ) from None

    def _follow_journal(self) -> None:
        """Apply the owner's slabs, puts and deletes recorded since this reader last looked."""
        for record in self._journal.new_records():
            if record[0] == "slab":
                self._paths.append(record[1])
                self._slabs.append(Slab(record[1], record[2], owner=False))
            elif record[0] == "put":
                self._units[record[1]] = record[2:]
            else:
                self._units.pop(record[1], None)

    def _view(self, key: UnitKey) -> np.ndarray:
        slab_index, offset, spec = self._locate(key)
        return self._slabs[slab_index].array(offset, spec.dtype, spec.shape)

    def _require_owner(self, op: str) -> None:
        if not self._owner:
            raise RuntimeError(
                f"{op}() on an attached shared-memory reader; write through the owner"
            )


def _unlink_all(paths: list[str], journal: str) -> None:
    for path in (*paths, journal):
        unlink_quietly(path)
