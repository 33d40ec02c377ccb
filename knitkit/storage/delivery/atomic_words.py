"""Release stores and acquire loads of 8-byte words in shared memory (see NOTE [ Publication ordering ])."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from collections.abc import Callable
from functools import lru_cache

import numpy as np

# NOTE [ Publication ordering ]
#
# A consumer must see a slot's payload and metadata complete once it sees PUBLISHED > seq, and a
# producer must see a consumer's reads of a slot finished once it sees RELEASED[c] past it. On
# aarch64 (Grace Hopper) and other weak memory models plain accesses do not give that: without
# ordering the PUBLISHED word can become visible before the data.
#
# There `store_release` is libatomic's `__atomic_store_8(ptr, value, __ATOMIC_RELEASE)` (every
# load and store before it in program order is visible to a thread that observes the stored
# value) and `load_acquire` is `__atomic_load_8(ptr, __ATOMIC_ACQUIRE)` (no load or store after it
# is performed before it). On x86-64 (TSO) every aligned 8-byte store IS a release store (stores
# become visible in program order) and every aligned 8-byte load an acquire load (loads are not
# reordered with older loads or stores), and each access here is a separate C call that the
# compiler cannot move the payload's reads and writes across; so x86-64 uses plain accesses
# through a memoryview: a quarter of a ctypes call's cost, which a consumer pays per micro-batch
# right after it wakes from compute (a ctypes call costs ~40 us with cold caches there).
# The hand-offs that use them (slot_ring.py, publication.py, consumer.py):
#   producer  fill slot, write metadata  -> store_release(PUBLISHED, seq + 1)
#   consumer  load_acquire(PUBLISHED)    -> read metadata and slot
#   consumer  finish reading the slot    -> store_release(RELEASED[c], s + 1)
#   producer  load_acquire(RELEASED[*])  -> overwrite the slot
#   producer  write the error text       -> store_release(STATE, FAILED)
# The word is aligned (8-byte offsets into a page-aligned mapping) and each has a single writer.
# libatomic ships with GCC's runtime (package libatomic1); machines other than x86-64 refuse to
# run without it.

_ACQUIRE, _RELEASE = 2, 3  # __ATOMIC_ACQUIRE, __ATOMIC_RELEASE


_Load = Callable[[int, int], int]
_Store = Callable[[int, int, int], None]


@lru_cache(maxsize=1)
def _libatomic() -> tuple[_Load, _Store] | None:
    """libatomic's 8-byte acquire load and release store; None on x86-64, where plain aligned
    accesses are both (see NOTE [ Publication ordering ])."""
    if platform.machine() in ("x86_64", "AMD64"):
        return None
    name = ctypes.util.find_library("atomic")
    if name is None:
        raise RuntimeError(
            f"libatomic is not installed on this {platform.machine()} machine; the shared-memory "
            "publication protocol needs its release/acquire operations (install libatomic1)"
        )
    lib = ctypes.CDLL(name)
    load = getattr(lib, "__atomic_load_8")  # getattr: a dunder name would be mangled in a class
    load.restype = ctypes.c_int64
    load.argtypes = (ctypes.c_void_p, ctypes.c_int)
    store = getattr(lib, "__atomic_store_8")
    store.restype = None
    store.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)
    return load, store


class AtomicWords:
    """Release/acquire access to the 8-byte words of ``words`` (an aligned int64 array)."""

    def __init__(self, words: np.ndarray) -> None:
        if words.dtype != np.int64 or words.ctypes.data % 8:
            raise ValueError("atomic words must be an 8-byte aligned int64 array")
        self._words = words
        self._base = words.ctypes.data
        ops = _libatomic()
        self._load: _Load | None = None if ops is None else ops[0]
        self._store: _Store | None = None if ops is None else ops[1]
        self._plain = words.data.cast("B").cast("q")
        """The words as plain 8-byte accesses (x86-64: acquire loads and release stores)."""

    def load_acquire(self, index: int) -> int:
        """Word ``index``; no later access of this thread is performed before this load."""
        if self._load is None:
            return int(self._plain[index])
        return int(self._load(self._base + 8 * index, _ACQUIRE))

    def store_release(self, index: int, value: int) -> None:
        """Store ``value``; every earlier access of this thread is visible before it."""
        if self._store is None:
            self._plain[index] = value
        else:
            self._store(self._base + 8 * index, value, _RELEASE)
