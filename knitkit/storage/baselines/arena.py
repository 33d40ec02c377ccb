"""Reused host memory for the baselines: what a careful user allocates once and fills every step."""

from __future__ import annotations

import numpy as np

_ALIGN = 64


class Arena:
    """One byte buffer handed out front to back and reused after ``reset``.

    A round that asks for more than the buffer holds gets fresh arrays for the excess and the
    next ``reset`` grows the buffer to the round's need, so from the second round on (a step of
    the same shape) nothing is allocated and every page is already faulted in.
    """

    def __init__(self, nbytes: int = 0) -> None:
        self._buffer = np.ones(nbytes, dtype=np.uint8)
        self._used = 0
        self._needed = 0

    @property
    def capacity(self) -> int:
        return int(self._buffer.nbytes)

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of uint8 memory, 64-byte aligned within the buffer, valid until ``reset``."""
        start = self._used
        self._needed = start + nbytes
        self._used = -(-(start + nbytes) // _ALIGN) * _ALIGN
        if start + nbytes <= self._buffer.nbytes:
            return self._buffer[start : start + nbytes]
        return np.empty(nbytes, dtype=np.uint8)

    def array(self, dtype: str | np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A ``take`` viewed as an array of ``dtype`` and ``shape``."""
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        return self.take(count * dt.itemsize).view(dt).reshape(shape)

    def reset(self) -> None:
        """Start a new round: earlier ``take`` results may be overwritten from now on."""
        if self._needed > self._buffer.nbytes:
            self._buffer = np.ones(self._needed + self._needed // 4, dtype=np.uint8)
        self._used = self._needed = 0
