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


class SegmentTruncatedError(OSError):
    """A mapped shared-memory segment was shrunk under its readers; the message names it."""


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
    Only the creating process unlinks: a forked child's copy never does (NOTE [ Owner-only
    clean-up ] in ``owner.py``). Lifecycle table: docs/lifecycle.md.

    NOTE [ Shrunk segments ]: any process of the same user can ``ftruncate`` a /dev/shm file, and
    touching a mapped page past the file's new end is a SIGBUS that kills the process, not an
    exception. So every access path checks the file's size first (``check_size``: one ``fstat``
    on the descriptor kept open for that purpose): a put, each slab once per ``read_many``, each
    ``read`` and ``view``. A shrunk slab then raises ``SegmentTruncatedError`` naming it, which
    the backend turns into ``UnitsLostError`` naming the units the read asked for. The
    check cannot cover a truncation between it and the copy that follows (microseconds), nor a
    zero-copy view held across one; sealing the size (``F_SEAL_SHRINK``) would, but only
    anonymous ``memfd`` segments can be sealed, and slabs keep names (NOTE [ Owner locks ]).
    """

    def __init__(self, path: str, size: int, *, owner: bool) -> None:
        self.path = path
        self.size = size
        self.owner = owner
        check_segment_name(os.path.basename(path))
        self._creator = os.getpid() if owner else 0
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if owner else os.O_RDONLY
        fd = os.open(path, flags, 0o600)
        try:
            if owner:
                reserve(fd, path, size)
            elif os.fstat(fd).st_size < size:
                raise SegmentTruncatedError(
                    f"shared-memory segment {path} holds {os.fstat(fd).st_size} bytes, its "
                    f"journal says {size}: another process of this user shrank it; its units "
                    "are lost"
                )
            access = mmap.ACCESS_WRITE if owner else mmap.ACCESS_READ
            self._map: mmap.mmap | None = mmap.mmap(fd, size, access=access)
        except BaseException:
            os.close(fd)
            if owner:
                unlink_quietly(path)
            raise
        self._fd: int | None = fd
        """Kept open for ``check_size`` (NOTE [ Shrunk segments ])."""
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

    def check_size(self) -> None:
        """Raise ``SegmentTruncatedError`` if the file is now shorter than its mapping (a read
        or write of the lost pages would be a SIGBUS; see NOTE [ Shrunk segments ])."""
        if self._fd is None:
            raise ValueError(f"slab {self.path} is closed")
        now = os.fstat(self._fd).st_size
        if now < self.size:
            raise SegmentTruncatedError(
                f"shared-memory segment {self.path} was truncated to {now} bytes under its "
                f"{self.size}-byte mapping (another process of this user shrank it); its units "
                "are lost: re-write them from a durable copy or re-issue their trajectories"
            )

    def close(self) -> None:
        """Unmap (once no view is left) and, in the creating process only, unlink the file."""
        if self.owner and os.getpid() == self._creator:  # NOTE [ Owner-only clean-up ]
            unlink_quietly(self.path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
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
