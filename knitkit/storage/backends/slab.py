"""A /dev/shm file mapped once and carved into aligned blocks: allocate shared pages once, reuse them."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import functools
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
        self._high = 0
        """End of the furthest unit this process knows of in the slab (its high-water mark)."""
        self._populated = 0
        """Leading bytes of this mapping whose pages are mapped (NOTE [ Populated mappings ])."""
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

    # NOTE [ Populated mappings ]: a reader (a reorganizer's copy of the store, a rank's) maps each
    # slab once, read-only, and copies units out of the mapping into its destination (a ring
    # slot). A page of a mapping is mapped at its first touch: a page fault (with fault-around,
    # one per 16 pages on tmpfs), so every unit a reader had not read before cost faults, and a
    # job's units are all new to it. ``populate`` maps the pages of the slab up to its high-water
    # mark (the end of the furthest unit the reader knows of, from the owner's journal) in one
    # ``MADV_POPULATE_READ`` before the reader's next read, whenever the mark moved: once per
    # slab and reader while a store fills, then never, since the owner's first-fit allocator
    # puts new units in freed extents below the mark. Populating costs what the faults cost
    # (~80 us per MiB here), once instead of at every new unit; past the mark nothing is mapped.
    # No memory is added: the pages are the store's own (a reader's RSS counts them, shared).
    # Considered instead: ``preadv`` from the slab's file into the slot, no mapping at all. On
    # this 2-core VM the kernel's copy (``_copy_to_iter``) moved 3 MiB from tmpfs in 530-700 us
    # against 180-240 us for a memcpy from mapped pages and ~480 us from freshly mapped ones
    # (scratch loop, thread time, medians): dearer than the faults it saves, at every read. The
    # disk backend reads its shards with ``preadv`` (NOTE [ Batched disk reads ]): a file that is
    # not shared memory gets no cheaper path. Safety is unchanged: the populated pages ARE the
    # slab's shared pages, so the owner's writes into a reused extent show through them; a reader
    # reads an extent only under the key the journal last put there (NOTE [ Unit journal ]); a
    # file shrunk under the mapping loses those pages (the kernel unmaps them) and every read
    # still checks the size first (NOTE [ Shrunk segments ]). The producer of a slot ring maps
    # its slots writable the same way once at start (``populate_writable``): write faults map a
    # single page each (~700 for a 2.7 MiB slot). Kernels before 5.14 refuse the advice
    # (EINVAL); pages are then mapped at first use, as before. Measured on transfer.py's
    # workload (a scratch script: one reorganizer in-process over a fresh reader, its TP
    # consumers in another process, 81 micro-batches of ~2.4 MiB, thread CPU, idle machine): 45
    # faults and 486 us per micro-batch before, none and 369 us after (its read_many 346 -> 215
    # us, of which ~183 us memcpy).
    def holds(self, end: int) -> None:
        """Note a unit of the slab that ends at byte ``end`` (its put, or its journal record)."""
        if end > self._high:
            self._high = end

    def populate(self) -> None:
        """Map every page up to the high-water mark now, if some are not yet (NOTE [ Populated
        mappings ]). A no-op (one compare) until the mark moves; ``SegmentTruncatedError`` if the
        file was shrunk under the mapping."""
        global _POPULATE
        if self._high <= self._populated or self._map is None:
            return
        if not _POPULATE:
            self._populated = self.size
            return
        end = min(-(-self._high // mmap.PAGESIZE) * mmap.PAGESIZE, self.size)
        self.check_size()  # populating pages past a shrunk file's end fails (EFAULT)
        try:
            self._map.madvise(MADV_POPULATE_READ, self._populated, end - self._populated)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # kernel < 5.14: pages fault in at first use
                _POPULATE = False
                self._populated = self.size
                return
            self.check_size()  # shrunk meanwhile: SegmentTruncatedError names the segment
            raise
        self._populated = end

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


MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
"""Linux >= 5.14: map a range's pages now, read or writable, without touching them from Python
(``mmap`` of Python 3.11 names neither)."""
_POPULATE = True
"""Whether this kernel populates mappings (cleared at the first EINVAL)."""


def populate_writable(buffer: memoryview) -> None:
    """Map the whole pages of a shared mapping's ``buffer`` writable now (``MADV_POPULATE_WRITE``;
    the bytes are unchanged), so a producer's first write to each takes no page fault (NOTE
    [ Populated mappings ]). Quietly nothing where the kernel cannot (< 5.14); a file shrunk under
    the mapping is left for the owner's size checks to name."""
    if not _POPULATE or not buffer.nbytes:
        return
    start = np.frombuffer(buffer, np.uint8).ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    length = (start + buffer.nbytes - first) // mmap.PAGESIZE * mmap.PAGESIZE
    if length > 0:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), MADV_POPULATE_WRITE)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


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
