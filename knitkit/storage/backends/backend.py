"""The backend seam: where atomic units physically live, and how ranges of them are read."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from knitkit.types import SeqRange, UnitKey


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """dtype and shape of a stored unit; axis 0 is the sequence axis that ranges index."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def row_nbytes(self) -> int:
        """Bytes of one sequence position (one row along axis 0)."""
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape[1:], dtype=np.int64)))

    @property
    def nbytes(self) -> int:
        return self.row_nbytes * (self.shape[0] if self.shape else 1)


@runtime_checkable
class UnitBackend(Protocol):
    """Stores atomic units by key and reads sequence ranges of them, moving only those bytes.

    Every backend (memory, shared memory, disk shards, Ray, Mooncake) passes the same
    test suite against this contract:
    - ``put`` of an existing key raises ``KeyError`` naming the key; the backend is unchanged.
    - ``replace`` requires the unit to exist with the same dtype and shape (``ValueError`` otherwise).
    - ``read`` of an unknown key raises ``KeyError``; a range outside ``[0, shape[0]]`` raises
      ``IndexError``; both name the key. Ranges are concatenated along axis 0 in the given order.
    - ``bytes_read`` counts the payload bytes moved by ``read`` since construction.
    """

    def put(self, key: UnitKey, array: np.ndarray) -> None: ...

    def replace(self, key: UnitKey, array: np.ndarray) -> None: ...

    def spec(self, key: UnitKey) -> UnitSpec: ...

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray: ...

    def delete(self, key: UnitKey) -> None: ...

    def keys(self) -> Iterator[UnitKey]: ...

    @property
    def bytes_read(self) -> int: ...

    def close(self) -> None: ...
