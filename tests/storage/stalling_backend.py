"""A backend wrapper whose read of one unit never returns: a stuck read, for liveness tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np

from knitkit.storage.backends.backend import UnitBackend, UnitSpec
from knitkit.types import SeqRange, UnitKey


class StallingBackend(UnitBackend):
    """Reads like ``inner`` except ``stall_on``, whose read blocks forever (a hung disk or peer).

    It inherits ``read_many`` from the protocol, so batched reads go through ``read`` too.
    """

    def __init__(self, inner: UnitBackend, stall_on: UnitKey) -> None:
        self.inner = inner
        self.stall_on = stall_on

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        self.inner.put(key, array)

    def replace(self, key: UnitKey, array: np.ndarray) -> None:
        self.inner.replace(key, array)

    def delete(self, key: UnitKey) -> None:
        self.inner.delete(key)

    def keys(self) -> Iterator[UnitKey]:
        return self.inner.keys()

    def spec(self, key: UnitKey) -> UnitSpec:
        return self.inner.spec(key)

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        if key == self.stall_on:
            threading.Event().wait()  # never set: the read hangs until the process is killed
        return self.inner.read(key, ranges, out)

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    def close(self) -> None:
        self.inner.close()
