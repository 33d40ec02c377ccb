"""A /dev/shm file mapped once and carved into aligned blocks: allocate shared pages once, reuse them."""

from __future__ import annotations

import bisect
import contextlib
import errno
import math
import mmap
import os

import numpy as np

from knitkit.storage.backends.segments import check_segment_name
from knitkit.types import LAYOUT_ALIGNMENT


def _aligned(nbytes: int) -> int:
    return max(LAYOUT_ALIGNMENT, -(-nbytes // LAYOUT_ALIGNMENT) * LAYOUT_ALIGNMENT)


class Slab:
    """One shared-memory file with a first-fit allocator; other processes map it by path.

    NOTE [ Slab lifetime ]: slabs are plain ``/dev/shm`` files, not ``multiprocessing.shared_memory``,
    so Python 3.11's resource tracker never sees them and cannot unlink them when a reader exits.
    Only the creating process (``owner=True``) unlinks, in ``close``; its owner also registers a
    ``weakref.finalize`` so an interpreter exit without ``close`` still unlinks. Readers map the
    file read-only and never unlink. A reader that maps after the owner unlinked gets
    ``FileNotFoundError``. The owner reserves every page at creation (``reserve``), so a full
    /dev/shm is an ``OSError`` there, never a SIGBUS on a later write; a failed creation leaves no
    file behind (and names are never reused, see NOTE [ Segment names ] in ``segments.py``).
    """

    def __init__(self, path: str, size: int, *, owner: bool) -> None:
        self.path = path
        self.size = size
        self.owner = owner
        check_segment_name(os.path.basename(path))
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if owner else os.O_RDONLY
        fd = os.open(path, flags, 0o600)
        try:
            if owner:
                reserve(fd, path, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(
                    f"slab {path} holds {os.fstat(fd).st_size} bytes, its journal says {size}"
                )
            access = mmap.ACCESS_WRITE if owner else mmap.ACCESS_READ
            self._map: mmap.mmap | None = mmap.mmap(fd, size, access=access)
        except BaseException:
            if owner:
                unlink_quietly(path)
            raise
        finally:
            os.close(fd)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._free: list[tuple[int, int]] = [(0, size)]
        """Free blocks ``(offset, size)`` sorted by offset, coalesced."""
        self._used: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a fresh aligned block of at least ``nbytes``, or ``None`` if none fits."""
        need = _aligned(nbytes)
        for i, (offset, size) in enumerate(self._free):
            if size >= need:
                if size == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, size - need)
                self._used[offset] = need
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev_offset, prev_size = self._free[i - 1]
            self._free[i - 1] = (prev_offset, prev_size + self._free.pop(i)[1])

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def array(self, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """Zero-copy view of a block (read-only in readers)."""
        count = math.prod(shape)
        nbytes = count * np.dtype(dtype).itemsize
        return self.bytes[offset : offset + nbytes].view(dtype).reshape(shape)

    def close(self) -> None:
        """Unmap (once no view is left) and, in the owner, unlink the file."""
        if self.owner:
            unlink_quietly(self.path)
        self.bytes = np.empty(0, dtype=np.uint8)
        if self._map is not None:
            # Views handed out may still be alive; the mapping then goes when they do.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


def reserve(fd: int, path: str, size: int) -> None:
    """Size a new segment and allocate all its pages now; ``OSError`` naming it if they do not fit.

    ``ftruncate`` alone makes a sparse file whose pages are allocated on first touch: on a full
    tmpfs that touch is a SIGBUS. ``posix_fallocate`` fails up front with ENOSPC instead.
    """
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return  # no fallocate on this file system: pages are allocated on first use
        stat = os.statvfs(os.path.dirname(path) or ".")
        raise OSError(
            exc.errno,
            f"cannot reserve {size} bytes for shared-memory segment {path}: "
            f"{os.strerror(exc.errno or 0)}; {stat.f_bavail * stat.f_frsize} bytes free in "
            f"{os.path.dirname(path)}; free memory there (release trajectories, run "
            "`knitkit shm-clean`) or use smaller slabs",
        ) from None


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
