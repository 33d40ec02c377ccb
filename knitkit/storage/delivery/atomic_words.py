"""Release stores, acquire loads and futex waits on 8-byte words in shared memory (NOTE [ Publication ordering ], NOTE [ Futex waits ])."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
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

_ACQUIRE, _RELEASE, _SEQ_CST = 2, 3, 5  # __ATOMIC_ACQUIRE, __ATOMIC_RELEASE, __ATOMIC_SEQ_CST

# NOTE [ Futex waits ]
#
# Waiting for a shared word to change (a consumer for PUBLISHED/NOTIFY, a producer for a
# consumer's RELEASED) blocks in the kernel instead of polling: `wait(index, expected, timeout)`
# is FUTEX_WAIT on the word, `wake(index)` FUTEX_WAKE of every waiter, after the store. Why a
# futex: the ring is one shared mapping that every process maps by name, so the word itself can be
# the wait queue (the kernel keys a shared futex by the page, not the address); an eventfd would
# have to be passed to every process over a socket, and a pipe costs a write per wake too.
# Measured once on the shared 2-core dev box under load (a micro-measurement, not a test): an idle
# waiting consumer spent 25 ms CPU per second with the old spin-then-sleep back-off (sleeps of up
# to 1 ms) and 3.4 ms with the futex (one wake per liveness period); publication to hand-out took
# 610 us (median; p90 1.1 ms) before and 250 us (p90 370 us) after, mostly scheduling delay. A
# wake costs ~1 us (a ctypes syscall), paid by whoever stores.
# - The words are 8 bytes, a futex is 32 bits: we wait on the word's low half (offset 0 on a
#   little-endian machine, 4 on a big-endian one), which changes on every increment of the
#   counters we wait on (PUBLISHED, NOTIFY, RELEASED only ever grow by small steps). The words
#   are 8-byte aligned, so their halves are 4-byte aligned as the kernel requires.
# - No lost wake-up: FUTEX_WAIT sleeps only if the word still holds `expected` (checked by the
#   kernel under its queue lock, with a full barrier), and the storer wakes after its store; a
#   waiter that read a stale value returns at once (EAGAIN) and looks again.
# - Every wait is bounded (`timeout_s`, the caller's liveness period), so a dead peer is seen
#   within one slice without any wake. A stop request (owner), a close or an interrupt (another
#   thread of the consumer's process) cannot change the word waited on (each word has one
#   writer), so they set their flag and wake: a waiter between its flag check and its sleep
#   misses that wake and sees the flag one slice later at most.
# - What each side waits on: a consumer on NOTIFY (bumped by the producer after every
#   publication and state change), the producer on the RELEASED word of the consumer that
#   released least. Between threads of one process the blocking primitives are threading's
#   (the prefetch thread's credits and result queue, Events for stop and cancel).
# - Spurious returns (a wake meant for another waiter, a signal) are harmless: callers loop.
# - A wake is a syscall through ctypes: ~6 us warm, tens of us right after compute (issue 31),
#   paid per release by every rank although the producer rarely waits. So the producer announces
#   its wait: it stores the waited consumer's index + 1 in its own word PRODUCER_WAITS before it
#   sleeps (0 after), and a consumer, having read that word with `store_then_loads` right after
#   its release store, wakes the word it names only if every consumer has now released the slot
#   the producer waits for (min RELEASED > PUBLISHED - num_slots: a waiting producer has
#   published everything before that slot), so TP consumers wake it once per slot, not once
#   each (issue 31: a wake cost a look-ahead reorganizer ~130 us of CPU under transfer.py's
#   load, ~2.5 wakes per micro-batch at TP2). No lost wake-up: the producer's store is
#   visible before the kernel compares the word it sleeps on (FUTEX_WAIT's full barrier, (A) in
#   kernel/futex), and the consumer's release store is visible before it loads PRODUCER_WAITS
#   (the full barrier of `store_then_loads`): of the two stores at least one side sees the
#   other's, so either the producer finds the new count and does not sleep, or the consumer
#   finds the producer waiting; the last consumer to release the slot sees every release before
#   its own and wakes it. A consumer that releases while another still holds the slot leaves
#   the producer asleep (its word changed, but the kernel compared it before the sleep).
# - The same handshake the other way for publications: a consumer about to sleep on NOTIFY for
#   a micro-batch stores 1 in its own word CONSUMER_WAITS[c] (0 after), and the producer, right
#   after it stores NOTIFY + 1 for a publication, reads those words (`store_then_loads`, the full
#   barrier between) and wakes only if one is set: the usual look-ahead case (consumers busy with
#   compute while the producer fills the next slot) makes no syscall per publication. State
#   changes (DONE, FAILED, a launcher's mark), a close and an interrupt still wake NOTIFY
#   unconditionally: watchers with no consumer index (`ProducerWatch`) wait for those only.
# - Off Linux, or on a machine whose futex syscall number we do not know, `wait` sleeps a short
#   back-off instead (portable fallback, polled).

_SYS_FUTEX = {"x86_64": 202, "AMD64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 2**31 - 1
_HALF = 0 if sys.byteorder == "little" else 4
"""Byte offset of an 8-byte word's low 32 bits (NOTE [ Futex waits ])."""
_FALLBACK_SLEEP_S = 0.0005
"""Poll period of the portable fallback."""


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


@lru_cache(maxsize=1)
def _futex() -> Callable[..., int] | None:
    """``syscall(SYS_futex, ...)`` bound to its number; None where futexes are not available."""
    number = _SYS_FUTEX.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
    syscall.argtypes = (
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    )
    return functools.partial(syscall, number)  # no Python frame per wait or wake


def futex_available() -> bool:
    """Whether waits block in the kernel (Linux) rather than poll (NOTE [ Futex waits ])."""
    return _futex() is not None


_Load = Callable[[int, int], int]
_Store = Callable[[int, int, int], None]
_Fence = Callable[[int], None]


@lru_cache(maxsize=1)
def _libatomic() -> tuple[_Load, _Store, _Fence] | None:
    """libatomic's 8-byte acquire load, release store and thread fence; None on x86-64, where
    plain aligned accesses are the first two (see NOTE [ Publication ordering ])."""
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
    fence = lib.atomic_thread_fence  # libatomic >= 1.2 (GCC 7)
    fence.restype = None
    fence.argtypes = (ctypes.c_int,)
    return load, store, fence


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
        self._futex = _futex()
        self._fence = threading.Lock()
        """Taken and dropped as a full barrier on x86-64 (``store_then_loads``)."""
        self._fence_call: _Fence | None = None if ops is None else ops[2]

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

    def loads_acquire(self, first: int, count: int) -> Sequence[int]:
        """``load_acquire`` of the ``count`` words from ``first``, in one call (the producer's
        look at every RELEASED word per slot, NOTE [ Slot path in few calls ] in
        publication.py): on x86-64 a view of the plain words, read when iterated."""
        if self._load is None:
            return self._plain[first : first + count]
        load, base = self._load, self._base
        return [int(load(base + 8 * index, _ACQUIRE)) for index in range(first, first + count)]

    def store_then_loads(self, index: int, value: int, first: int, count: int) -> Sequence[int]:
        """Release-store ``value`` in word ``index``, then ``loads_acquire(first, count)`` with a
        full barrier between: the store is visible to every process before the loads read (NOTE
        [ Futex waits ], where such a pair decides whether to wake). x86-64 reorders only a later
        load before an earlier store, and a lock's acquire is an atomic read-modify-write there,
        a full barrier; elsewhere libatomic's ``atomic_thread_fence(seq_cst)``."""
        self.store_release(index, value)
        if self._fence_call is None:
            with self._fence:
                pass
        else:
            self._fence_call(_SEQ_CST)
        return self.loads_acquire(first, count)

    def wait(self, index: int, expected: int, timeout_s: float) -> None:
        """Sleep while word ``index`` holds ``expected``, at most ``timeout_s``; may return early
        (a wake, a signal, another waiter's wake): callers look again (NOTE [ Futex waits ])."""
        if timeout_s <= 0:
            return
        if self._futex is None:
            time.sleep(min(timeout_s, _FALLBACK_SLEEP_S))
            return
        low = expected & 0xFFFFFFFF
        seconds = int(timeout_s)
        timeout = _Timespec(seconds, int((timeout_s - seconds) * 1e9))
        address = self._base + 8 * index + _HALF
        self._futex(
            address,
            _FUTEX_WAIT,
            low - (1 << 32) if low >= 1 << 31 else low,
            ctypes.addressof(timeout),
            None,
            0,
        )

    def wake(self, index: int) -> None:
        """Wake every process and thread waiting on word ``index`` (after storing to it)."""
        if self._futex is not None:
            self._futex(self._base + 8 * index + _HALF, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
