"""Which pages of a private (copy-on-write) file mapping this process wrote, from its page map."""

from __future__ import annotations

import mmap
import os

import numpy as np

_PAGE = mmap.PAGESIZE
_PRESENT, _SWAPPED, _FILE_PAGE = 63, 62, 61
"""Bits of a /proc/<pid>/pagemap entry (Linux >= 3.5): page present, swapped, file-backed."""


class WrittenPages:
    """Finds the pages of ``mapping`` (a MAP_PRIVATE mapping of a shared file) that this process
    has written: a written page is a private anonymous copy, an unwritten one is still the file's
    page (NOTE [ Zero-copy hand-off ] in knitkit/microbatch_iter/worker.py). One ``pread`` of
    8 bytes per page of /proc/self/pagemap, no page-table change."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._address = np.frombuffer(mapping, np.uint8, 1).ctypes.data
        self._pid = 0
        self._fd: int | None = None
        self.readable = True
        """False once the page map could not be read: every range then counts as written."""

    def span(self, start: int, nbytes: int) -> tuple[int, int] | None:
        """The smallest page-aligned ``(offset, length)`` of the mapping that covers every page of
        ``[start, start + nbytes)`` this process wrote; ``None`` if it wrote none. Where the page
        map cannot be read, the whole range (widened to pages)."""
        low = start - start % _PAGE
        pages = (start + nbytes - low + _PAGE - 1) // _PAGE
        entries = self._entries(low, pages)
        if entries is None:
            return low, pages * _PAGE
        mapped = (entries >> _PRESENT) | (entries >> _SWAPPED)
        written = np.flatnonzero(mapped & ~(entries >> _FILE_PAGE) & 1)
        if written.size == 0:
            return None
        first, last = int(written[0]), int(written[-1])
        return low + first * _PAGE, (last + 1 - first) * _PAGE

    def _entries(self, offset: int, pages: int) -> np.ndarray | None:
        if not self.readable:
            return None
        try:
            if self._fd is None or self._pid != os.getpid():  # a forked child reads its own map
                self.close()
                self._fd, self._pid = os.open("/proc/self/pagemap", os.O_RDONLY), os.getpid()
            raw = os.pread(self._fd, 8 * pages, 8 * ((self._address + offset) // _PAGE))
        except OSError:
            self.readable = False
            self.close()
            return None
        if len(raw) != 8 * pages:
            self.readable = False
            return None
        return np.frombuffer(raw, np.uint64)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
