"""The shared-memory segment behind micro-batch publication: control words, slot metadata, slots."""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import resource
import secrets
import struct
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker

import numpy as np

from knitkit.storage.backends.segments import (
    RING_OWNER_BYTE,
    SHM_DIR,
    byte_locked,
    check_segment_name,
    lock_byte,
    sweep_dead_segments,
)
from knitkit.storage.backends.slab import MADV_POPULATE_READ, reserve
from knitkit.storage.delivery.atomic_words import AtomicWords
from knitkit.storage.delivery.layout_codec import LayoutDecodeError, decode_layout, encode_layout
from knitkit.storage.delivery.written_pages import WrittenPages
from knitkit.types import MicroBatchLayout

# Segment layout and word ownership: see NOTE [ Micro-batch publication protocol ] in publication.py.

# NOTE [ Ring role locks ]
#
# Who is alive on a ring is decided by kernel locks on the ring file, not by pids: a pid means
# nothing in another pid namespace, and ranks in containers that share /dev/shm (`--ipc=host`)
# do not share pids with the driver. Each role holds an exclusive open-file-description lock
# (F_OFD_SETLK) on its own byte of the ring file for as long as it plays the role: byte 0 the
# OWNER (from before the ring has a name until it is unlinked), byte 1 the PRODUCER
# (`Publisher.start` until it closes), byte 2 + c CONSUMER c (attach until detach). The kernel
# drops a lock when the last descriptor of its open file description closes, however the process
# ends (SIGKILL included), and every process that opens the file, in any pid namespace, sees it
# (F_OFD_GETLK). So a consumer counts its producer dead once byte 1 is free while the ring runs;
# a producer gives up once byte 0 is free (its owner is gone); taking byte 2 + c is the attach
# itself, so a second consumer on one index is refused in any process; and a sweep removes a
# ring only while it holds byte 0 itself (NOTE [ Segment names ]). A forked child shares its
# parent's descriptors and keeps the parent's roles alive until it exits too: conservative,
# never a false death. Nobody unlocks explicitly (a fork sharing the open file description would
# unlock its parent's role): a role ends when its descriptor closes. The pid words stay as hints
# for people and to say how a consumer left (NOTE [ Micro-batch publication protocol ], "Dead
# consumers"). One gap no lock closes: a producer that dies before it takes byte 1 leaves the
# ring STARTING, the same as a slow start. Its launcher (the owner, who sees the child's exit
# code) then stores the negated pid in the producer-pid word (`mark_exited_before_start`), and a
# consumer waiting on a STARTING ring counts that as a death at once, not at its start-up bound.
#
# A ring appears complete or not at all: its owner creates an unnamed file in /dev/shm
# (O_TMPFILE), locks byte 0, sizes and reserves it, writes the control block and MAGIC, and only
# then gives it its name (linkat through /proc/self/fd). So nobody attaching sees a file of 0
# bytes or without MAGIC from a creator at work (a creation killed half-way leaves nothing). A
# name that holds no complete ring anyway (a foreign file, a ring truncated by a process of this
# user) makes `attach` raise RingNotReadyError, as an absent name does: a wait for a ring to
# appear (the driver's collector, a rank following a restarted reorganizer) keeps waiting within
# its bound, then reports what it found.

STARTING, RUNNING, DONE, FAILED = 0, 1, 2, 3
_MAGIC = 0x4B4E4954_52494E47
_MAGIC_W, _STATE_W, _PRODUCER_PID_W, _OWNER_PID_W = 0, 1, 2, 3
_PUBLISHED_W, _BYTES_READ_W, _STOP_W, _ERROR_LEN_W, _HEARTBEAT_W, _NOTIFY_W = 4, 5, 6, 7, 8, 9
_PRODUCER_WAITS_W = 10
"""The producer's: index + 1 of the consumer whose RELEASED word it sleeps on, 0 while it does
not sleep (NOTE [ Futex waits ] in atomic_words.py)."""
_FILL_NS_W = 11
"""The producer's thread CPU nanoseconds spent writing micro-batches into slots (NOTE [ Fill
time ] in reorganizer.py)."""
_RELEASED_W = 16
"""RELEASED[c] is word ``_RELEASED_W + c``; CONSUMER_PID[c] follows the RELEASED words, then
CONSUMER_WAITS[c]: 1 while consumer c sleeps on NOTIFY for a publication, else 0 (consumer c's;
NOTE [ Futex waits ] in atomic_words.py)."""
_ERROR_BYTES = 4096
_PAGE = mmap.PAGESIZE
_META_HEADER = struct.Struct("<qq")
"""Before each slot's layout record: the micro-batch's seq and the record's length."""
HEARTBEAT_S = 0.25
"""How often an idle producer refreshes its heartbeat (a busy one beats on progress); a
consumer's ``liveness_timeout_s`` must span several beats (default 30 s)."""


class RingClosedError(RuntimeError):
    """The ring's owner asked the producer to stop, or the owner is gone."""


class ConsumerDiedError(RuntimeError):
    """A consumer died holding a slot the producer waits for; the ring can never move again."""


class RingTruncatedError(RuntimeError):
    """The ring's segment file is shorter than the ring: a process of this user truncated it."""


class RingNotReadyError(FileNotFoundError):
    """No complete ring under the name: absent (not created yet, or removed), or a file that is
    not a whole ring; waits for a ring to appear keep waiting (NOTE [ Ring role locks ])."""


class RingIncompleteError(RingNotReadyError, RingTruncatedError):
    """At attach: the file under the ring's name is shorter than the ring."""


_PRODUCER_BYTE = RING_OWNER_BYTE + 1
"""Byte of the ring file the producer locks; consumer c locks ``_PRODUCER_BYTE + 1 + c``."""
LEFT = -1
"""Sign of a consumer pid word once it left a live stream (NOTE [ Micro-batch publication
protocol ], "Dead consumers")."""


@dataclass(frozen=True, slots=True)
class RingSpec:
    """Where and how big a slot ring is; a plain value handed to every process that maps it."""

    name: str
    """Segment name under /dev/shm."""
    num_slots: int
    """Look-ahead bound: micro-batches published but not yet released by every consumer."""
    slot_bytes: int
    """Capacity of one slot; the largest packed micro-batch must fit."""
    num_consumers: int
    """TP ranks that read every micro-batch."""
    meta_bytes: int = 64 * 1024
    """Capacity of one slot's layout record (``layout_codec``: field views, cu_seqlens_padded,
    trajectory ids)."""

    def __post_init__(self) -> None:
        check_segment_name(self.name)

    @classmethod
    def new(
        cls, *, num_slots: int, slot_bytes: int, num_consumers: int, prefix: str = "knitkit"
    ) -> RingSpec:
        if num_slots < 1 or num_consumers < 1 or slot_bytes < 1:
            raise ValueError(
                f"ring needs num_slots, num_consumers, slot_bytes >= 1; got "
                f"{num_slots}, {num_consumers}, {slot_bytes}"
            )
        name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
        return cls(name, num_slots, _round_up(slot_bytes, _PAGE), num_consumers)

    @property
    def _num_words(self) -> int:
        return _RELEASED_W + 3 * self.num_consumers

    @property
    def _error_offset(self) -> int:
        return _round_up(8 * self._num_words, 64)

    @property
    def _meta_offset(self) -> int:
        return self._error_offset + _ERROR_BYTES

    @property
    def _data_offset(self) -> int:
        return _round_up(self._meta_offset + self.num_slots * self.meta_bytes, _PAGE)

    @property
    def segment_bytes(self) -> int:
        return self._data_offset + self.num_slots * self.slot_bytes


class SlotRing:
    """A mapped slot ring: typed views of its control block, slot metadata and slot payloads."""

    def __init__(self, spec: RingSpec, fd: int, *, owner: bool, read_only_slots: bool) -> None:
        """Map the ring file ``fd`` (kept open: role locks, ``check_size``); ``create`` and
        ``attach`` build rings."""
        self.spec = spec
        self._fd: int | None = fd
        self._owner = os.getpid() if owner else 0
        """The creating process: the only one that unlinks (NOTE [ Owner-only clean-up ])."""
        self._roles: set[int] = set()
        """Bytes of the ring file this object's descriptor locks (NOTE [ Ring role locks ])."""
        self._head: mmap.mmap | None = mmap.mmap(fd, spec._data_offset)
        """Control block, error text and slot metadata: read-write for every role."""
        prot = mmap.PROT_READ if read_only_slots else mmap.PROT_READ | mmap.PROT_WRITE
        self._data: mmap.mmap | None = mmap.mmap(
            fd, spec.segment_bytes - spec._data_offset, prot=prot, offset=spec._data_offset
        )
        """The shared slots: the producer writes them; consumers map them read-only and hand out
        views of their private copy-on-write mapping (``private_slot``)."""
        self._buf = memoryview(self._head)
        self._slots = memoryview(self._data)
        self._private: mmap.mmap | None = None
        self._private_view = memoryview(b"")
        """The private mapping as a memoryview (once mapped), sliced per hand-out."""
        self._private_at = 0
        """Address of the private mapping's first byte (once mapped)."""
        self._written: WrittenPages | None = None
        self._mapped: dict[int, int] = {}
        """Slot index -> leading bytes whose pages the private mapping has mapped (populated)."""
        self._clean_at: dict[int, int] = {}
        """Slot index -> this process's page-fault count when the slot was last known to hold no
        private copy (NOTE [ Written pages only after a fault ])."""
        self.page_map_reads = 0
        """Releases that read the page map to find written pages (the others had no fault)."""
        self.release_wakes = 0
        """Releases that woke the producer (a syscall; the others found it not sleeping)."""
        self.publish_wakes = 0
        """Publications that woke consumers (a syscall; the others found none sleeping)."""
        self._populate = True
        self.words = np.frombuffer(self._buf, np.int64, spec._num_words)
        self._atomic = AtomicWords(self.words)
        self._heartbeat = np.frombuffer(self._buf, np.float64, 1, 8 * _HEARTBEAT_W)
        # offsets as plain ints: a consumer computes them per micro-batch right after waking
        self._segment_bytes = spec.segment_bytes
        self._meta_at = spec._meta_offset
        self._num_slots, self._meta_bytes = spec.num_slots, spec.meta_bytes
        self._num_consumers = spec.num_consumers
        self._waits_at = _RELEASED_W + 2 * spec.num_consumers
        """Word of CONSUMER_WAITS[0]."""

    @classmethod
    def create(cls, spec: RingSpec) -> SlotRing:
        """Create the ring, complete, under its name (NOTE [ Ring role locks ]); its pages are
        reserved now. The caller owns it: it holds the owner's lock and must ``unlink``."""
        path = _path(spec)
        _sweep_once()
        fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR, 0o600)
        try:
            lock_byte(fd, RING_OWNER_BYTE)  # a fresh unnamed file: nobody else can hold it
            reserve(fd, path, spec.segment_bytes)  # every page now, or OSError
            ring = cls(spec, fd, owner=True, read_only_slots=False)
        except BaseException:
            os.close(fd)
            raise
        try:
            ring._roles.add(RING_OWNER_BYTE)
            ring.words[_OWNER_PID_W] = os.getpid()
            ring._heartbeat[0] = time.monotonic()
            ring.words[_MAGIC_W] = _MAGIC
            directory = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.link(f"/proc/self/fd/{fd}", spec.name, dst_dir_fd=directory)
            finally:
                os.close(directory)
        except FileExistsError:
            ring.close()
            raise FileExistsError(
                f"slot ring {spec.name!r} already exists ({path}): a RingSpec is created once; "
                "make a new one (RingSpec.new)"
            ) from None
        except BaseException:
            ring.close()
            raise
        # the backstop if this owner alone is SIGKILLed; a whole-job kill: the start-up sweep
        resource_tracker.register(f"/{spec.name}", "shared_memory")
        return ring

    @classmethod
    def attach(cls, spec: RingSpec, *, read_only_slots: bool = False) -> SlotRing:
        """Map an existing ring by file (no resource-tracker registration: see NOTE [ Micro-batch
        publication protocol ] in publication.py); ``RingNotReadyError`` if its name holds no
        complete ring (NOTE [ Ring role locks ])."""
        path = _path(spec)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise RingNotReadyError(
                f"slot ring {spec.name!r} does not exist ({path}); its owner must create it "
                "first and keep it until every producer and consumer has closed"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < spec.segment_bytes:
                raise RingIncompleteError(
                    f"slot ring {spec.name!r} ({path}) is {size} bytes, not the ring's "
                    f"{spec.segment_bytes}: not a complete ring (a file that is not one, or a "
                    "ring a process of this user truncated)"
                )
            ring = cls(spec, fd, owner=False, read_only_slots=read_only_slots)
        except BaseException:
            os.close(fd)
            raise
        if ring.words[_MAGIC_W] != _MAGIC:
            ring.close()
            raise RingNotReadyError(f"{path} is not a knitkit slot ring (no MAGIC)")
        return ring

    # -- roles (NOTE [ Ring role locks ]) --
    def claim_producer(self) -> None:
        """Take the producer's role lock; ``RuntimeError`` if a live producer holds it."""
        self._claim(_PRODUCER_BYTE, "a live producer already publishes into it")

    def claim_consumer(self, consumer: int) -> bool:
        """Take consumer ``consumer``'s role lock; False if a live process holds it."""
        byte = _PRODUCER_BYTE + 1 + consumer
        if byte in self._roles or not lock_byte(self._fd_or_raise(), byte):
            return False
        self._roles.add(byte)
        return True

    @property
    def owner_alive(self) -> bool:
        """Whether the owner holds its role lock (in any pid namespace)."""
        return self._held(RING_OWNER_BYTE)

    @property
    def producer_alive(self) -> bool:
        """Whether a producer holds its role lock (in any pid namespace)."""
        return self._held(_PRODUCER_BYTE)

    def consumer_attached(self, consumer: int) -> bool:
        """Whether a process holds consumer ``consumer``'s role lock (in any pid namespace)."""
        return self._held(_PRODUCER_BYTE + 1 + consumer)

    def _claim(self, byte: int, why: str) -> None:
        if byte not in self._roles and not lock_byte(self._fd_or_raise(), byte):
            raise RuntimeError(f"slot ring {self.spec.name!r}: {why}")
        self._roles.add(byte)

    def _held(self, byte: int) -> bool:
        return byte in self._roles or byte_locked(self._fd_or_raise(), byte)

    def _fd_or_raise(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"slot ring {self.spec.name!r} is closed")
        return self._fd

    def check_size(self) -> None:
        """Raise ``RingTruncatedError`` if the segment file shrank under this mapping (reading a
        page past its end would kill the process with SIGBUS); one fstat, paid per hand-out
        (``_segment_bytes`` is ``spec.segment_bytes`` computed once: a chain of properties that
        cost more than the ``fstat``)."""
        fd = self._fd
        if fd is None:
            return
        size = os.fstat(fd).st_size
        if size < self._segment_bytes:
            raise RingTruncatedError(
                f"slot ring {self.spec.name!r} (/dev/shm/{self.spec.name}) is {size} bytes, "
                f"shorter than the ring's {self._segment_bytes}: a process of this user "
                "truncated it under its consumers; restart its reorganizer (and keep other "
                "jobs out of this /dev/shm)"
            )

    # -- control words (each has a single writer; see NOTE [ Micro-batch publication protocol ]) --
    @property
    def state(self) -> int:
        return self._atomic.load_acquire(_STATE_W)

    def set_state(self, state: int) -> None:
        """Producer: store STATE and notify waiting consumers (NOTE [ Futex waits ])."""
        self._atomic.store_release(_STATE_W, state)
        self._notify()

    @property
    def failed(self) -> bool:
        """True once the producer reported an error (``set_error``)."""
        return self.state == FAILED

    @property
    def producer_pid(self) -> int:
        return int(self.words[_PRODUCER_PID_W])

    def set_producer_pid(self, pid: int) -> None:
        self.words[_PRODUCER_PID_W] = pid

    @property
    def exited_before_start(self) -> bool:
        """Whether the launcher saw the producer exit before it started (NOTE [ Ring role locks ])."""
        return self.producer_pid < 0

    def mark_exited_before_start(self) -> None:
        """Launcher: its producer process exited before taking its role lock."""
        self.words[_PRODUCER_PID_W] = -abs(self.producer_pid)
        self._notify()

    @property
    def owner_pid(self) -> int:
        return int(self.words[_OWNER_PID_W])

    @property
    def published(self) -> int:
        """Micro-batches published so far (acquire: their slots and metadata are visible)."""
        return self._atomic.load_acquire(_PUBLISHED_W)

    def set_published(self, count: int) -> None:
        """Release store: the slots and metadata written before become visible with it; then
        notify, waking the consumers only if one sleeps for a publication (a syscall only then:
        NOTE [ Futex waits ] in atomic_words.py)."""
        self._atomic.store_release(_PUBLISHED_W, count)
        # NOTIFY has one writer, the producer: a plain read of its own word is current
        notify = int(self.words[_NOTIFY_W]) + 1
        if any(
            self._atomic.store_then_loads(_NOTIFY_W, notify, self._waits_at, self._num_consumers)
        ):
            self._atomic.wake(_NOTIFY_W)
            self.publish_wakes += 1

    @property
    def notified(self) -> int:
        """Producer events so far (publications, state changes): what consumers wait on."""
        return self._atomic.load_acquire(_NOTIFY_W)

    def wait_notified(self, seen: int, timeout_s: float, consumer: int | None = None) -> None:
        """Sleep until the producer's next event after ``seen`` (``notified``), at most
        ``timeout_s``; may return early (NOTE [ Futex waits ] in atomic_words.py). A publication
        wakes only a waiter that names its ``consumer`` index (announced in CONSUMER_WAITS);
        state changes, closes and interrupts wake every waiter."""
        if consumer is None:
            self._atomic.wait(_NOTIFY_W, seen, timeout_s)
            return
        word = self._waits_at + consumer
        self._atomic.store_release(word, 1)  # before the kernel's check
        try:
            self._atomic.wait(_NOTIFY_W, seen, timeout_s)
        finally:
            self._atomic.store_release(word, 0)

    def wake_consumers(self) -> None:
        """Wake every waiting consumer (they look again); for a close or an interrupt."""
        self._atomic.wake(_NOTIFY_W)

    def _notify(self) -> None:
        # NOTIFY has one writer, the producer: a plain read of its own word is current
        self._atomic.store_release(_NOTIFY_W, int(self.words[_NOTIFY_W]) + 1)
        self._atomic.wake(_NOTIFY_W)

    @property
    def bytes_read(self) -> int:
        """Payload bytes the producer read from its backend so far."""
        return int(self.words[_BYTES_READ_W])

    @property
    def fill_s(self) -> float:
        """Thread CPU seconds the producer spent writing micro-batches into slots so far (NOTE
        [ Fill time ] in reorganizer.py)."""
        return int(self.words[_FILL_NS_W]) / 1e9

    def count_fill(self, nbytes: int, cpu_ns: int) -> None:
        """Producer: a micro-batch's payload bytes read from the backend and the thread CPU
        nanoseconds its fill took, counted before it is published."""
        words = self.words
        words[_BYTES_READ_W] += nbytes
        words[_FILL_NS_W] += cpu_ns

    @property
    def stop_requested(self) -> bool:
        return bool(self.words[_STOP_W])

    def request_stop(self) -> None:
        """Owner: ask the producer to stop, waking it if it waits for a release."""
        self.words[_STOP_W] = 1
        for consumer in range(self.spec.num_consumers):
            self._atomic.wake(_RELEASED_W + consumer)

    def min_released(self) -> int:
        """The fewest micro-batches any consumer released (acquire loads, in one call)."""
        return min(self._atomic.loads_acquire(_RELEASED_W, self._num_consumers))

    def lagging(self) -> tuple[int, int]:
        """The consumer that released the fewest micro-batches, and its count."""
        counts = list(self._atomic.loads_acquire(_RELEASED_W, self._num_consumers))
        least = min(counts)
        return counts.index(least), least

    def released(self, consumer: int) -> int:
        """Consumer's release count (acquire: its reads of released slots are finished)."""
        return self._atomic.load_acquire(_RELEASED_W + consumer)

    def set_released(self, consumer: int, count: int) -> None:
        """Consumer: release store of its count, then wake the producer if it sleeps and every
        consumer has now released the slot it waits for (a syscall only then, one per slot:
        NOTE [ Futex waits ] in atomic_words.py)."""
        atomic = self._atomic
        waits = atomic.store_then_loads(_RELEASED_W + consumer, count, _PRODUCER_WAITS_W, 1)[0]
        if not waits:
            return
        if self.min_released() > atomic.load_acquire(_PUBLISHED_W) - self._num_slots:
            atomic.wake(_RELEASED_W + waits - 1)  # the word it sleeps on
            self.release_wakes += 1

    def wait_released(self, consumer: int, seen: int, timeout_s: float) -> None:
        """Producer: sleep while ``consumer``'s count is ``seen``, at most ``timeout_s``; may
        return early (NOTE [ Futex waits ] in atomic_words.py)."""
        self._atomic.store_release(_PRODUCER_WAITS_W, consumer + 1)  # before the kernel's check
        try:
            self._atomic.wait(_RELEASED_W + consumer, seen, timeout_s)
        finally:
            self._atomic.store_release(_PRODUCER_WAITS_W, 0)

    def consumer_waits(self, consumer: int) -> bool:
        """Whether ``consumer`` sleeps for a publication now (it announced it)."""
        return bool(self._atomic.load_acquire(self._waits_at + consumer))

    @property
    def producer_waits_on(self) -> int | None:
        """The consumer whose release the producer sleeps on now, if any."""
        waits = self._atomic.load_acquire(_PRODUCER_WAITS_W)
        return waits - 1 if waits else None

    def consumer_pid(self, consumer: int) -> int:
        """Pid of the process attached as ``consumer``: 0 if none attached (yet, or it detached
        at the end of its stream), ``LEFT * pid`` if it left a live stream (NOTE [ Micro-batch
        publication protocol ], "Dead consumers")."""
        return int(self.words[_RELEASED_W + self.spec.num_consumers + consumer])

    def set_consumer_pid(self, consumer: int, pid: int) -> None:
        self.words[_RELEASED_W + self.spec.num_consumers + consumer] = pid

    # -- slots --
    def slot(self, seq: int, nbytes: int) -> memoryview:
        start = (seq % self._num_slots) * self.spec.slot_bytes
        return self._slots[start : start + nbytes]

    def private_slot(self, seq: int, nbytes: int) -> memoryview:
        """The first ``nbytes`` of ``seq``'s slot through this process's one copy-on-write mapping
        of the data region, mapped once per ring, each slot's pages faulted in whole at its first
        use: reads see the shared pages, writes stay in this process (NOTE [ Zero-copy hand-off ]
        in knitkit/microbatch_iter/worker.py); ``drop_private`` before the release."""
        return self.private_slot_at(seq, nbytes)[0]

    def private_slot_at(self, seq: int, nbytes: int) -> tuple[memoryview, int]:
        """``private_slot`` and the address of its first byte (a consumer builds its lease's
        array interface from it: no array made to learn it, NOTE [ Lease in few calls ] in
        consumer.py)."""
        if self._private is None:
            length = self._num_slots * self.spec.slot_bytes
            self._private = mmap.mmap(
                self._fd_or_raise(),
                length,
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=self.spec._data_offset,
            )
            self._written = WrittenPages(self._private)
            self._private_view = memoryview(self._private)  # released by close()
            # the array holds an export of the mapping only while this line runs
            self._private_at = int(np.frombuffer(self._private, np.uint8, 1).ctypes.data)
        slot = seq % self._num_slots
        start = slot * self.spec.slot_bytes
        mapped = self._mapped.get(slot, 0)
        if nbytes > mapped:  # pages stay mapped across occupants: faulted in once per slot
            whole = self.spec.slot_bytes  # later, larger occupants need no call of their own
            if self._populate:
                try:  # here (the prefetch thread), not in the training step
                    self._private.madvise(
                        MADV_POPULATE_READ, *_pages(start + mapped, whole - mapped)
                    )
                except OSError:
                    self._populate = False  # kernel < 5.14: the first reads fault them in
            self._mapped[slot] = whole
        return self._private_view[start : start + nbytes], self._private_at + start

    def drop_private(self, seq: int, nbytes: int) -> None:
        """Drop this process's private copies of the pages of ``seq``'s first ``nbytes`` it wrote
        (MADV_DONTNEED over their span), so the slot's next occupant is read from the shared
        pages. The written pages are found from the page map, with no page-table change, and only
        if this process took a page fault since the slot was last known clean: none in the usual
        read-only case (NOTE [ Written pages only after a fault ])."""
        if self._private is None or self._written is None or not nbytes:
            return
        slot = seq % self._num_slots
        # this process's page faults so far, every thread (NOTE [ Written pages only after a
        # fault ]); read before the page map is: a later write faults again
        usage = resource.getrusage(resource.RUSAGE_SELF)
        faults = usage.ru_minflt + usage.ru_majflt
        if self._clean_at.get(slot) == faults:
            return
        start = slot * self.spec.slot_bytes
        self.page_map_reads += 1
        span = self._written.span(start, nbytes)
        if span is not None:
            self._private.madvise(mmap.MADV_DONTNEED, *span)
            self._mapped[slot] = min(self._mapped.get(slot, 0), span[0] - start)
        self._clean_at[slot] = faults

    def write_meta(self, seq: int, layout: MicroBatchLayout, record: bytes | None = None) -> None:
        """Write ``seq``'s layout record (``record``, or ``encode_layout(layout)``)."""
        blob = encode_layout(layout) if record is None else record
        if len(blob) + _META_HEADER.size > self.spec.meta_bytes:
            raise ValueError(
                f"micro-batch {seq}: layout metadata takes {len(blob)} bytes, more than the "
                f"ring's meta_bytes={self.spec.meta_bytes}; build the RingSpec with a larger one"
            )
        start = self._meta_at + (seq % self._num_slots) * self._meta_bytes
        body = start + _META_HEADER.size
        self._buf[body : body + len(blob)] = blob
        _META_HEADER.pack_into(self._buf, start, seq, len(blob))

    def read_meta(self, seq: int) -> MicroBatchLayout:
        """The layout published with ``seq``, decoded as data (``layout_codec``) and checked to
        lie inside one slot; ``RuntimeError`` naming the ring and the bad field otherwise."""
        start = self._meta_at + (seq % self._num_slots) * self._meta_bytes
        stored_seq, length = _META_HEADER.unpack_from(self._buf, start)
        if stored_seq != seq:
            raise RuntimeError(f"slot ring {self.spec.name!r}: slot holds {stored_seq}, not {seq}")
        if not 0 <= length <= self._meta_bytes - _META_HEADER.size:
            raise RuntimeError(
                f"slot ring {self.spec.name!r}: slot {seq} claims {length} metadata bytes"
            )
        body = start + _META_HEADER.size
        try:
            return decode_layout(self._buf[body : body + length].tobytes(), self.spec.slot_bytes)
        except LayoutDecodeError as exc:
            raise RuntimeError(
                f"slot ring {self.spec.name!r}: malformed metadata of micro-batch {seq}: {exc}; "
                "its producer wrote a corrupt record (restart the reorganizer)"
            ) from None

    @property
    def heartbeat(self) -> float:
        return float(self._heartbeat[0])

    def beat(self) -> None:
        self._heartbeat[0] = time.monotonic()

    def set_error(self, message: str) -> None:
        blob = message.encode()[:_ERROR_BYTES]
        start = self.spec._error_offset
        self._buf[start : start + len(blob)] = blob
        self._atomic.store_release(_ERROR_LEN_W, len(blob))

    def error(self) -> str:
        start = self.spec._error_offset
        length = min(self._atomic.load_acquire(_ERROR_LEN_W), _ERROR_BYTES)
        return bytes(self._buf[start : start + length]).decode(errors="replace")

    def close(self) -> None:
        """Unmap (views still held elsewhere keep a mapping alive until they are dropped) and
        close the file: this object's roles end (NOTE [ Ring role locks ])."""
        self.words = np.zeros(self.spec._num_words, np.int64)
        self._atomic = AtomicWords(self.words)
        self._heartbeat = np.zeros(1, np.float64)
        if self._written is not None:
            self._written.close()
        for view in (self._buf, self._slots, self._private_view):
            with contextlib.suppress(BufferError):  # arrays over it are still alive
                view.release()
        for mapped in (self._head, self._data, self._private):
            if mapped is not None:
                with contextlib.suppress(BufferError):  # a caller still holds zero-copy views
                    mapped.close()
        self._head = self._data = self._private = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._roles.clear()

    def unlink(self) -> None:
        """Remove the ring's name (owner only; a no-op in a forked copy: NOTE [ Owner-only
        clean-up ] in backends/owner.py); idempotent."""
        if not self._owner:
            raise RuntimeError(f"slot ring {self.spec.name!r}: only its owner may unlink it")
        if os.getpid() == self._owner and unlink_ring(self.spec.name):
            resource_tracker.unregister(f"/{self.spec.name}", "shared_memory")


def unlink_ring(name: str) -> bool:
    """Remove a ring's /dev/shm name without mapping it; True if it existed."""
    check_segment_name(name)
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return False
    return True


@functools.cache
def _sweep_once() -> None:
    """The first ring a process creates sweeps /dev/shm of what dead owners left (their locks are
    free: NOTE [ Segment names ]): a job resumed over a disk store, which starts no
    ``SharedMemoryBackend`` and so no start-up sweep, removes the rings of the run it follows."""
    sweep_dead_segments(SHM_DIR)


def _path(spec: RingSpec) -> str:
    return os.path.join(SHM_DIR, spec.name)


# NOTE [ Written pages only after a fault ]
#
# A release must find the pages of its lease this process wrote (private copy-on-write copies,
# NOTE [ Zero-copy hand-off ] in knitkit/microbatch_iter/worker.py) before the slot's next
# occupant is read. Reading the page map for that touches every page's struct page: 60-75 us per
# 2.7 MiB lease, most of a rank's CPU per micro-batch (RANK31's scratch profile of transfer.py's
# fields, issue 31). But a page of the private mapping can only become a private copy through a
# page fault of this process: `private_slot` maps every page read-only (populated, or absent
# until read), so the first write to each one faults (a write-protect or a missing-page fault;
# also a write by the kernel on the process's behalf, `read()` into the buffer or a pinning
# `get_user_pages`), and the kernel counts every fault in the process's rusage (minor + major, all
# threads, exited ones included; a count that only grows). So each slot keeps the fault count
# read just BEFORE its page map was last read (or its written pages dropped): while the count is
# unchanged at the next release, nothing in the process faulted since the slot was known clean,
# hence no page of it was written, and the page map is not read (one getrusage, ~1 us). Any
# fault (a write to another slot, the allocator growing, a populate) makes the next release of
# every slot read its page map as before: the check can only skip work, never a write.
# Not seen: a write into this process's memory by ANOTHER process (process_vm_writev, ptrace),
# whose faults are counted in that process; the lease contract's "no writes" covers those.


def _pages(start: int, nbytes: int) -> tuple[int, int]:
    """``[start, start + nbytes)`` widened to whole pages, as madvise wants it."""
    low = start - start % _PAGE
    return low, _round_up(start + nbytes, _PAGE) - low


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
