"""The shared-memory segment behind micro-batch publication: control words, slot metadata, slots."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct
import time
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from knitkit.storage.backends.segments import check_segment_name
from knitkit.storage.backends.slab import reserve
from knitkit.storage.delivery.atomic_words import AtomicWords
from knitkit.storage.delivery.layout_codec import LayoutDecodeError, decode_layout, encode_layout
from knitkit.storage.delivery.written_pages import WrittenPages
from knitkit.types import MicroBatchLayout

# Segment layout and word ownership: see NOTE [ Micro-batch publication protocol ] in publication.py.

STARTING, RUNNING, DONE, FAILED = 0, 1, 2, 3
_MAGIC = 0x4B4E4954_52494E47
_MAGIC_W, _STATE_W, _PRODUCER_PID_W, _OWNER_PID_W = 0, 1, 2, 3
_PUBLISHED_W, _BYTES_READ_W, _STOP_W, _ERROR_LEN_W, _HEARTBEAT_W, _NOTIFY_W = 4, 5, 6, 7, 8, 9
_RELEASED_W = 16
"""RELEASED[c] is word ``_RELEASED_W + c``; CONSUMER_PID[c] follows the RELEASED words."""
_ERROR_BYTES = 4096
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22
"""Linux >= 5.14: fault a range's pages in (read) without touching them from Python."""
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
        return _RELEASED_W + 2 * self.num_consumers

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

    def __init__(self, spec: RingSpec, buf: memoryview, owner: shared_memory.SharedMemory | None):
        self.spec = spec
        self._buf = buf
        self._owner = owner
        self._mmap: mmap.mmap | None = None
        self._fd: int | None = None
        """Attached rings keep the segment's file open to check its size (``check_size``)."""
        self._private: mmap.mmap | None = None
        self._written: WrittenPages | None = None
        self._mapped: dict[int, int] = {}
        """Slot index -> leading bytes whose pages the private mapping has mapped (populated)."""
        self._populate = True
        self.words = np.frombuffer(buf, np.int64, spec._num_words)
        self._atomic = AtomicWords(self.words)
        self._heartbeat = np.frombuffer(buf, np.float64, 1, 8 * _HEARTBEAT_W)
        # offsets as plain ints: a consumer computes them per micro-batch right after waking
        self._meta_at, self._data_at = spec._meta_offset, spec._data_offset
        self._num_slots, self._meta_bytes = spec.num_slots, spec.meta_bytes

    @classmethod
    def create(cls, spec: RingSpec) -> SlotRing:
        """Create the segment and fault its pages in; the caller owns it and must ``unlink``."""
        shm = shared_memory.SharedMemory(spec.name, create=True, size=spec.segment_bytes)
        fd = os.open(f"/dev/shm/{spec.name}", os.O_RDWR)
        try:
            reserve(fd, f"/dev/shm/{spec.name}", spec.segment_bytes)  # every page now, or OSError
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        finally:
            os.close(fd)
        assert shm.buf is not None
        ring = cls(spec, shm.buf, shm)
        ring.words[_OWNER_PID_W] = os.getpid()
        ring._heartbeat[0] = time.monotonic()
        ring.words[_MAGIC_W] = _MAGIC
        return ring

    @classmethod
    def attach(cls, spec: RingSpec) -> SlotRing:
        """Map an existing ring by file (no resource-tracker registration: see
        NOTE [ Micro-batch publication protocol ] in publication.py)."""
        path = f"/dev/shm/{spec.name}"
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"slot ring {spec.name!r} does not exist ({path}); its owner must create it "
                "first and keep it until every producer and consumer has closed"
            ) from None
        try:
            _check_size(spec, fd)
            mapped = mmap.mmap(fd, spec.segment_bytes)
        except BaseException:
            os.close(fd)
            raise
        ring = cls(spec, memoryview(mapped), None)
        ring._mmap = mapped
        ring._fd = fd
        if ring.words[_MAGIC_W] != _MAGIC:
            ring.close()
            raise ValueError(f"/dev/shm/{spec.name} is not a knitkit slot ring")
        return ring

    def check_size(self) -> None:
        """Raise ``RingTruncatedError`` if the segment file shrank under this mapping (reading a
        page past its end would kill the process with SIGBUS); attached rings only, one fstat."""
        if self._fd is not None:
            _check_size(self.spec, self._fd)

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
    def owner_pid(self) -> int:
        return int(self.words[_OWNER_PID_W])

    @property
    def published(self) -> int:
        """Micro-batches published so far (acquire: their slots and metadata are visible)."""
        return self._atomic.load_acquire(_PUBLISHED_W)

    def set_published(self, count: int) -> None:
        """Release store: the slots and metadata written before become visible with it; then
        notify waiting consumers."""
        self._atomic.store_release(_PUBLISHED_W, count)
        self._notify()

    @property
    def notified(self) -> int:
        """Producer events so far (publications, state changes): what consumers wait on."""
        return self._atomic.load_acquire(_NOTIFY_W)

    def wait_notified(self, seen: int, timeout_s: float) -> None:
        """Consumer: sleep until the producer's next event after ``seen`` (``notified``), at
        most ``timeout_s``; may return early (NOTE [ Futex waits ] in atomic_words.py)."""
        self._atomic.wait(_NOTIFY_W, seen, timeout_s)

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

    def add_bytes_read(self, nbytes: int) -> None:
        self.words[_BYTES_READ_W] += nbytes

    @property
    def stop_requested(self) -> bool:
        return bool(self.words[_STOP_W])

    def request_stop(self) -> None:
        """Owner: ask the producer to stop, waking it if it waits for a release."""
        self.words[_STOP_W] = 1
        for consumer in range(self.spec.num_consumers):
            self._atomic.wake(_RELEASED_W + consumer)

    def min_released(self) -> int:
        return self.lagging()[1]

    def lagging(self) -> tuple[int, int]:
        """The consumer that released the fewest micro-batches, and its count."""
        counts = [self.released(c) for c in range(self.spec.num_consumers)]
        least = min(counts)
        return counts.index(least), least

    def released(self, consumer: int) -> int:
        """Consumer's release count (acquire: its reads of released slots are finished)."""
        return self._atomic.load_acquire(_RELEASED_W + consumer)

    def set_released(self, consumer: int, count: int) -> None:
        """Consumer: release store of its count, then wake a producer waiting for it."""
        self._atomic.store_release(_RELEASED_W + consumer, count)
        self._atomic.wake(_RELEASED_W + consumer)

    def wait_released(self, consumer: int, seen: int, timeout_s: float) -> None:
        """Producer: sleep while ``consumer``'s count is ``seen``, at most ``timeout_s``; may
        return early (NOTE [ Futex waits ] in atomic_words.py)."""
        self._atomic.wait(_RELEASED_W + consumer, seen, timeout_s)

    def consumer_pid(self, consumer: int) -> int:
        """Pid of the process attached as ``consumer`` (0: none attached yet)."""
        return int(self.words[_RELEASED_W + self.spec.num_consumers + consumer])

    def set_consumer_pid(self, consumer: int, pid: int) -> None:
        self.words[_RELEASED_W + self.spec.num_consumers + consumer] = pid

    # -- slots --
    def slot(self, seq: int, nbytes: int) -> memoryview:
        start = self._data_at + (seq % self._num_slots) * self.spec.slot_bytes
        return self._buf[start : start + nbytes]

    def private_slot(self, seq: int, nbytes: int) -> memoryview:
        """The first ``nbytes`` of ``seq``'s slot through this process's one copy-on-write mapping
        of the data region, mapped once per ring and its pages faulted in once per slot: reads
        see the shared pages, writes stay in this process (NOTE [ Zero-copy hand-off ] in
        knitkit/microbatch_iter/worker.py); ``drop_private`` before the release."""
        if self._private is None:
            if self._fd is None:
                raise RuntimeError(
                    f"slot ring {self.spec.name!r}: only attached rings map privately"
                )
            length = self._num_slots * self.spec.slot_bytes
            self._private = mmap.mmap(
                self._fd,
                length,
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=self._data_at,
            )
            self._written = WrittenPages(self._private)
        slot = seq % self._num_slots
        start = slot * self.spec.slot_bytes
        mapped = self._mapped.get(slot, 0)
        if nbytes > mapped:  # pages stay mapped across occupants: only new ones are faulted in
            if self._populate:
                try:  # here (the prefetch thread), not in the training step
                    self._private.madvise(
                        _MADV_POPULATE_READ, *_pages(start + mapped, nbytes - mapped)
                    )
                except OSError:
                    self._populate = False  # kernel < 5.14: the first reads fault them in
            self._mapped[slot] = nbytes
        return memoryview(self._private)[start : start + nbytes]

    def drop_private(self, seq: int, nbytes: int) -> None:
        """Drop this process's private copies of the pages of ``seq``'s first ``nbytes`` it wrote
        (MADV_DONTNEED over their span; none in the usual read-only case, found from the page map
        with no page-table change), so the slot's next occupant is read from the shared pages."""
        if self._private is None or self._written is None or not nbytes:
            return
        slot = seq % self._num_slots
        start = slot * self.spec.slot_bytes
        span = self._written.span(start, nbytes)
        if span is not None:
            self._private.madvise(mmap.MADV_DONTNEED, *span)
            self._mapped[slot] = min(self._mapped.get(slot, 0), span[0] - start)

    def write_meta(self, seq: int, layout: MicroBatchLayout) -> None:
        blob = encode_layout(layout)
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
        """Unmap; views still held elsewhere keep the mapping alive until they are dropped."""
        self.words = np.zeros(self.spec._num_words, np.int64)
        self._atomic = AtomicWords(self.words)
        self._heartbeat = np.zeros(1, np.float64)
        try:
            if self._owner is not None:
                self._owner.close()
            elif self._mmap is not None:
                self._buf.release()
                self._mmap.close()
        except BufferError:
            pass  # a caller still holds zero-copy views; the mapping goes with them
        if self._written is not None:
            self._written.close()
        if self._private is not None:
            with contextlib.suppress(BufferError):
                self._private.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def unlink(self) -> None:
        """Remove the segment name (owner only); idempotent."""
        if self._owner is None:
            raise RuntimeError(f"slot ring {self.spec.name!r}: only its owner may unlink it")
        with contextlib.suppress(FileNotFoundError):
            self._owner.unlink()


def unlink_ring(name: str) -> bool:
    """Remove a ring's /dev/shm name without mapping it; True if it existed."""
    check_segment_name(name)
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        return False
    return True


def _check_size(spec: RingSpec, fd: int) -> None:
    size = os.fstat(fd).st_size
    if size < spec.segment_bytes:
        raise RingTruncatedError(
            f"slot ring {spec.name!r} (/dev/shm/{spec.name}) is {size} bytes, shorter than the "
            f"ring's {spec.segment_bytes}: a process of this user truncated it under its "
            "consumers; restart its reorganizer (and keep other jobs out of this /dev/shm)"
        )


def _pages(start: int, nbytes: int) -> tuple[int, int]:
    """``[start, start + nbytes)`` widened to whole pages, as madvise wants it."""
    low = start - start % _PAGE
    return low, _round_up(start + nbytes, _PAGE) - low


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
