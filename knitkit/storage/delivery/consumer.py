"""Consumer side of micro-batch publication: the next packed micro-batch as a lease on its slot."""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from knitkit.storage.backends.lost import UnitsLostError, lost_units_in
from knitkit.storage.delivery.liveness import CHECK_EVERY_S, LONGEST_CHECK_S, WaitSlices
from knitkit.storage.delivery.slot_ring import (
    DONE,
    FAILED,
    LEFT,
    RUNNING,
    STARTING,
    RingSpec,
    SlotRing,
)
from knitkit.types import MicroBatchLayout, PackedMicroBatch, slot_setters

CLOSE_WAIT_S = 10.0
"""How long ``close()`` waits for a ``next_micro_batch()`` of another thread to leave (at once,
or within one liveness period, at most ``LONGEST_CHECK_S``, if it missed the wake: NOTE
[ Liveness checks back off ] in liveness.py)."""

_ATTACHED: set[tuple[str, int]] = set()
"""(ring name, consumer index) of every consumer attached in this process."""
_ATTACHED_LOCK = threading.RLock()  # reentrant: a GC finalizer may run while it is held
_PID = [os.getpid()]
"""This process's pid, set again in a forked child: a release compares it with its consumer's
instead of calling ``os.getpid()`` (a syscall per release, NOTE [ Lease in few calls ])."""
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


class ReorganizerError(RuntimeError):
    """The reorganizer feeding this consumer failed; the message carries its error."""


class ReorganizerUnitsLostError(UnitsLostError, ReorganizerError):
    """The reorganizer failed because units it had to read are lost; ``.keys`` names them
    (see NOTE [ Lost units reach the trainer ]). Caught as either ``UnitsLostError`` or
    ``ReorganizerError``."""


def _failure(producer: str, ring: str, text: str) -> ReorganizerError:
    """The typed error for a ring whose ``producer`` failed with ``text``: lost units stay
    named."""
    lost = lost_units_in(text)
    if lost:
        return ReorganizerUnitsLostError(lost, f"the {producer} of ring {ring!r}", text)
    return ReorganizerError(f"{producer} of ring {ring!r}: {text}")


class ReorganizerDiedError(RuntimeError):
    """The reorganizer feeding this consumer died (or stopped beating) before finishing."""


class ConsumerClosedError(RuntimeError):
    """A micro-batch was asked of a consumer that is closed (or was closed while it waited)."""


@dataclass(frozen=True, slots=True)
class Producer:
    """Who fills a ring, as a consumer's errors name it: what it is and what to do once it died."""

    name: str = "reorganizer"
    remedy: str = "restart the mini-batch's reorganizers"


REORGANIZER = Producer()


class _Releases:
    """A consumer's release count: ``RELEASED[c]`` moves to ``s + 1`` once ``s`` and every
    micro-batch before it were released (in any order). Thread-safe (a lease may be released by
    any thread); kept apart from the consumer so leases do not keep it alive. Only the attaching
    process releases: a forked child's copies of leases (a DataLoader worker) hand nothing back."""

    def __init__(self, ring: SlotRing, index: int):
        self._ring = ring
        self._index = index
        self._pid = _PID[0]
        self._lock = threading.RLock()  # reentrant: a dropped lease's finalizer may run under it
        self._closed = False
        self.count = ring.released(index)
        self._early: set[int] = set()
        self.held: dict[int, int] = {}
        """seq -> bytes of the private view of each lease handed out and not released yet (NOTE
        [ Zero-copy hand-off ]); its backstop (``_SlotBytes``) reads it, a test without a call
        (NOTE [ Lease in few calls ]). Written only under the lock."""
        self._slots: list[tuple[memoryview, int]] = [
            (np.frombuffer(view, np.uint8).data, address)
            for view, address in (
                ring.private_slot_at(slot, ring.spec.slot_bytes)
                for slot in range(ring.spec.num_slots)
            )
        ]
        """Per slot index, its whole private view, over an exporter of its own, and the address
        of its first byte (NOTE [ One exporter per slot ]), mapped here, at attach (NOTE [ Slots
        mapped at attach ])."""

    def lease(self, layout: MicroBatchLayout, seq: int) -> PackedMicroBatch:
        """Lease ``seq`` (``layout``) through this process's copy-on-write mapping: its view is
        the first ``layout.nbytes`` of its slot's exporter (NOTE [ One exporter per slot ]); the
        lease and its ``_SlotBytes`` are built here, in one frame (NOTE [ Lease in few calls ])."""
        nbytes = layout.nbytes
        with self._lock:
            if self._closed:
                raise ConsumerClosedError(
                    f"consumer {self._index} of ring {self._ring.spec.name!r} is closed; its "
                    "micro-batches can no longer be read"
                )
            self.held[seq] = nbytes
            whole = self._slots[seq % len(self._slots)]
        view = whole[0][:nbytes]
        holder = _new(_SlotBytes)  # NOTE [ Lease backstop ]
        holder.view = view
        holder.releases = self
        holder.seq = seq
        holder.__array_interface__ = {
            "data": (whole[1], True),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
        lease = _new(PackedMicroBatch)
        set_layout, set_buffer, set_on_release, set_seq, set_private, set_released = _LEASE_SLOTS
        set_layout(lease, layout)
        set_buffer(lease, np.asarray(holder))
        set_on_release(lease, functools.partial(self.release, seq))  # C-level: no frame of its own
        set_seq(lease, seq)
        # the lease's private() is this very view (a C-level callable: no Python frame per call):
        # booked once, mapped once per hand-out
        set_private(lease, itertools.repeat(view).__next__)
        set_released(lease, False)
        return lease

    def release(self, seq: int) -> None:
        """Release ``seq``; a second call returns at once (its lease's ``release()`` and then its
        backstop, or ``release_all``), from any thread."""
        with self._lock:
            nbytes = self.held.pop(seq, None)
            if nbytes is None or self._closed or _PID[0] != self._pid:
                return
            # private copies go first: the slot's next occupant must be read from shared pages
            self._ring.drop_private(seq, nbytes)
            if seq == self.count and not self._early:  # in order, the usual case
                self.count += 1
            else:
                self._early.add(seq)
                while self.count in self._early:
                    self._early.remove(self.count)
                    self.count += 1
            self._ring.set_released(self._index, self.count)

    def release_all(self, upto: int) -> None:
        """Release every micro-batch before ``upto`` (a closing consumer hands all back)."""
        for seq in range(self.count, upto):
            self.release(seq)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._slots.clear()  # the mapping closes once no view handed out is left


# NOTE [ Lease in few calls ]: a rank hands out a lease per micro-batch right after its compute,
# with cold caches, where every Python-level operation costs ~3x its warm time (NOTE [ Zero-copy
# hand-off ] in knitkit/microbatch_iter/worker.py), so the lease path is kept to few calls and
# objects: the slot's address comes with its private view (``SlotRing.private_slot_at``, the
# mapping's address read once per ring) and the lease's array interface is written from it, with
# no array made to learn it; one object per lease is its bytes' holder and its backstop at once
# (``_SlotBytes``), its ``private()`` and its ``on_release`` are C-level callables (an
# ``itertools.repeat``'s ``__next__``, a ``functools.partial`` of ``_Releases.release``, which
# itself returns at once for a lease released before: no once-only wrapper's frame); flags read
# per micro-batch are plain attributes, not Events (``is_set`` is a Python frame); the wait's
# clock runs only when there is a wait; an in-order release moves the count without the
# early-release set; a release that comes second (the backstop after ``release()``) returns
# without raising; the lease, its ``_SlotBytes`` and its private view are made in one frame,
# without their ``__init__`` (``_Releases.lease``); a release compares the pid saved at fork
# (``_PID``) instead of
# calling ``getpid`` (a syscall); a take's ``next_lease`` is its ``_next`` and calls the consumer
# directly. Those last three, with the iterator's (one staging frame, stats built without a
# builder's frame), against 8014ff5 over a ring published ahead of the loop (no waits, so counted
# exactly): a new shape 118 -> 113 calls, 38 -> 33 Python frames; a repeated one 81 -> 76. Their
# time is inside the noise on the 2-core dev box at load 19-35: a hand-out right after a compute
# burst (scratch, thread CPU, medians of 300) 425 -> 415 us over 9 back-to-back pairs (new lower
# in 5); warm, the lease's build and release 3.6 -> 1.9 us (issue 31, stop 44). Earlier, with a
# producer thread racing the loop (so waits counted too), Python and C calls per hand-out over a
# 3-slot ring of transfer.py's 9 fields (tests/storage/test_handout_calls.py): a new shape each
# time 140-151 (~48 Python frames) against 161-164 (~61) at 1cebb89 and ~200 at 62f8166; a
# repeated shape 101-117 against 153-166 (NOTE [ Shapes decoded once ] in layout_codec.py);
# with the iterator's cuts (NOTE [ Hand-out objects without __init__ ] in
# knitkit/microbatch_iter/batch.py). Of a new shape's calls ~30 are per field
# (its FieldView's and its view's). Measured at 3500aa2 against 1cebb89, 3 back-to-back pairs at
# load 8-21 (issue 31, wave 8): prefetch.py's loop-thread CPU in next() 43 -> 35 us per
# micro-batch (medians); transfer.py --quick's ranks 0.0312 -> 0.0307 CPU s/step (medians; the
# ~12 fewer Python frames are ~1 ms of the ranks' ~17 ms data-path CPU per step, inside that
# machine's run-to-run spread of 2-4 ms). Stop 48 (the C-level ``on_release``, ``_Releases.lease``,
# with the codec's and the iterator's cuts: NOTE [ Shapes decoded once ] in layout_codec.py,
# ``build_micro_batch``, views looked up before ``check_layout``): a new shape 113 -> 108 calls,
# 33 -> 29 frames; a repeated one 76 -> 66 calls, 31 -> 26 frames.


# NOTE [ Slots mapped at attach ]: a consumer maps every slot's pages through its private
# mapping when it attaches (its ``_Releases`` takes ``SlotRing.private_slot_at`` of each whole
# slot, a populate where the kernel has one, and keeps the views), not at each slot's first
# lease: that first lease paid the populate, ~50 page faults and 250-500 us of the rank's thread
# CPU per 3 MiB slot (transfer.py --quick, scratch instrumentation of the rank's ``next()``, load
# 15-19, issue 31), inside a step whenever a ring's slots outnumber the micro-batches of the
# first step: the encoder ring of TP0/CP0, one micro-batch per step, populated its second slot in
# a measured step. A consumer attaches once per job or pass, before its first step; attaching
# costs the whole ring's populate up front.


# NOTE [ One exporter per slot ]: a lease's private view is the first ``nbytes`` of a view of its
# whole slot whose exporter (``view.obj``, a numpy array over the slot's pages of the private
# mapping) is made once per slot and consumer, so a CPU ``MicroBatchIterator`` taking leases
# inline recognises the slot by that object and keeps one flat tensor over the whole slot, with
# its dtype views, for the consumer's life: per hand-out it makes no tensor over the buffer
# (``torch.frombuffer``, ~30 us right after compute), and a micro-batch larger than the slot's
# last one does not make its dtype views again (NOTE [ Slot tensors kept ] in
# knitkit/microbatch_iter/worker.py). Pages a loop wrote are still dropped at the release; the
# next reads fault them back from the shared pages (the slot is populated once, at its first
# use).


class _SlotBytes:
    """A slot's bytes under the array interface, read-only. numpy collapses a view's base to
    the first object that is not an array, so every array (and tensor) over a lease's buffer
    keeps this object alive: once nothing can read the slot any more, it releases a lease nobody
    released (a backstop; ``release()`` is the contract: the lease's ``on_release``, a
    ``functools.partial`` of its ``_Releases.release``, no frame of its own; NOTE [ Lease in few
    calls ]).

    NOTE [ Lease backstop ]: the backstop was a ``weakref.finalize`` per lease (~3 us, and an
    entry added to and removed from its class-wide registry per micro-batch). In a rank process
    started by fork, that made the process take about one page fault per hand-out, and any page
    fault makes the next release read the page map (NOTE [ Written pages only after a fault ] in
    slot_ring.py): a forked rank handing out transfer.py-sized micro-batches back to back had
    258-267 of 297 releases read it, 29-32 with this ``__del__``; a spawned rank 21-23 and 11-13
    (RANK31's scratch driver over a real ring, 2-core dev box, issue 31). Unlike
    ``finalize(atexit=False)``, a ``__del__`` may run during interpreter shutdown: by then the
    consumer has closed its release count (its own finalizer runs at exit), so the release
    returns at once.
    """

    __slots__ = ("__array_interface__", "releases", "seq", "view")

    view: memoryview
    """The lease's bytes (it keeps the mapping alive)."""
    releases: _Releases
    """The release count the lease goes back to."""
    seq: int
    __array_interface__: dict[str, object]
    """``view``'s bytes at their address, read-only."""

    def __del__(self) -> None:
        if self.seq in self.releases.held:  # the usual case: released already, no call
            self.releases.release(self.seq)


_new = object.__new__
_LEASE_SLOTS = slot_setters(PackedMicroBatch)


def _detach(ring: SlotRing, releases: _Releases, key: tuple[str, int]) -> None:
    """Forget the attachment and unmap (``close()``, or GC or interpreter exit of a consumer
    never closed). A consumer that leaves while its producer still runs marks its pid word
    ``LEFT``: its TP peers cannot go on without it, so the producer fails the ring once it waits
    for it (NOTE [ Micro-batch publication protocol ], "Dead consumers")."""
    releases.close()
    index = key[1]
    pid = os.getpid()
    if ring.consumer_pid(index) == pid:  # never a forked copy's: the parent is still attached
        live = ring.state in (STARTING, RUNNING)
        ring.set_consumer_pid(index, LEFT * pid if live else 0)
    ring.close()
    with _ATTACHED_LOCK:
        _ATTACHED.discard(key)


class MicroBatchConsumer(Iterator[PackedMicroBatch]):
    """One TP rank's handle on its (DP, CP) group's slot ring (see NOTE [ Micro-batch publication protocol ] in publication.py).

    Every hand-out is a lease (``knitkit.types.PackedMicroBatch``) over the slot's first
    ``layout.nbytes`` bytes, read-only, in publication order (``seq`` counts micro-batches
    across mini-batches): its holder releases it exactly once (``release()`` or ``with lease:``;
    in any order, the slot frees once every earlier one is released too); a lease dropped
    unreleased is released once no array or tensor over its bytes is left. ``next_micro_batch()``
    and iteration hand out the same leases and release nothing themselves; a
    ``MicroBatchIterator`` owns the leases it pulls. ``take(n)`` iterates exactly ``n``.
    The consumer starts no thread: the caller's thread (the iterator's prefetch thread) waits,
    decodes and maps.
    """

    def __init__(
        self,
        spec: RingSpec,
        consumer_index: int,
        *,
        liveness_timeout_s: float = 30.0,
        startup_timeout_s: float = 120.0,
        wait_timeout_s: float = 600.0,
        producer: Producer = REORGANIZER,
    ):
        """Attach as TP consumer ``consumer_index``; see NOTE [ Micro-batch publication protocol ].

        ``liveness_timeout_s``: a producer that makes no progress this long counts as dead.
        ``wait_timeout_s``: the default bound of ``next_micro_batch`` (``math.inf`` to wait
        while the producer lives, e.g. for a mini-batch that is still being generated).
        ``producer``: how errors name the ring's producer (a reorganizer by default).
        """
        if not 0 <= consumer_index < spec.num_consumers:
            raise ValueError(
                f"consumer_index={consumer_index} outside ring {spec.name!r}'s "
                f"{spec.num_consumers} consumers"
            )
        self.name = f"consumer {consumer_index} of ring {spec.name!r}"
        key = (spec.name, consumer_index)
        with _ATTACHED_LOCK:
            if key in _ATTACHED:
                raise ValueError(
                    f"consumer_index={consumer_index} of ring {spec.name!r} is already attached "
                    f"in this process (pid {os.getpid()}): two "
                    "handles would move one release count and hand out every micro-batch twice; "
                    "each TP rank attaches once, with its own index (close the other one first)"
                )
            _ATTACHED.add(key)
        try:
            ring = SlotRing.attach(spec, read_only_slots=True)  # it hands out private views
        except BaseException:
            with _ATTACHED_LOCK:
                _ATTACHED.discard(key)
            raise
        if not ring.claim_consumer(consumer_index):  # NOTE [ Ring role locks ] in slot_ring.py
            holder = abs(ring.consumer_pid(consumer_index))
            ring.close()
            with _ATTACHED_LOCK:
                _ATTACHED.discard(key)
            raise ValueError(
                f"consumer_index={consumer_index} of ring {spec.name!r} is attached by a live "
                f"process, pid {holder} (in its own pid namespace); each TP rank attaches with "
                "its own index"
            )
        ring.set_consumer_pid(consumer_index, os.getpid())
        self.producer = producer
        self._ring = ring
        self._index = consumer_index
        self._wait_timeout_s = wait_timeout_s
        self._liveness_timeout_s = liveness_timeout_s
        self._startup_deadline = time.monotonic() + startup_timeout_s
        self._releases = _Releases(ring, consumer_index)
        self._next = ring.released(consumer_index)
        self._busy = threading.Lock()
        """Held by the thread inside ``next_micro_batch`` (one at a time)."""
        self._closed = False
        self._interrupted = threading.Event()
        self._detach = weakref.finalize(self, _detach, ring, self._releases, key)
        self._wait_s = self._decode_s = 0.0
        self._handed_out = self._handed_out_bytes = 0

    @property
    def producer_bytes_read(self) -> int:
        """Bytes the reorganizer read from storage so far (for accounting)."""
        return self._ring.bytes_read

    def next_micro_batch(
        self, timeout_s: float | None = None, *, cancel: threading.Event | None = None
    ) -> PackedMicroBatch:
        """Wait for the next published micro-batch and lease it; ``StopIteration`` when the
        producer is done.

        Raises ``ReorganizerError`` if the producer failed, ``ReorganizerDiedError`` if it died
        or made no progress for ``liveness_timeout_s``, ``TimeoutError`` if ``timeout_s``
        (default: the consumer's ``wait_timeout_s``) passes while it lives and published nothing,
        ``ConsumerClosedError`` at once if the consumer is (or gets) closed, ``InterruptedError``
        once ``cancel`` is set (or ``interrupt()`` was called).
        """
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"{self.name}: next_micro_batch() is already running in another thread; take "
                "micro-batches from one thread at a time (one MicroBatchIterator at a time)"
            )
        try:
            if self._closed:
                raise ConsumerClosedError(f"{self.name} is closed")
            timeout = self._wait_timeout_s if timeout_s is None else timeout_s
            seq = self._next
            ring = self._ring
            if ring.published <= seq:  # the usual look-ahead case skips the wait's set-up
                start = time.perf_counter()
                self._wait_published(seq, timeout, cancel)
                published = time.perf_counter()
                self._wait_s += published - start
            else:
                published = time.perf_counter()
            ring.check_size()  # a truncated segment would SIGBUS below
            layout = ring.read_meta(seq)
            releases = self._releases
            # every hand-out reads through this process's copy-on-write mapping (NOTE [ Zero-copy
            # hand-off ] in knitkit/microbatch_iter/worker.py): numpy views are read-only, but a
            # write through ``torch.from_numpy`` of one stays with this rank, never its TP peers
            lease = releases.lease(layout, seq)
            self._next = seq + 1
            self._decode_s += time.perf_counter() - published
            self._handed_out += 1
            self._handed_out_bytes += layout.nbytes
            return lease
        finally:
            self._busy.release()

    def __next__(self) -> PackedMicroBatch:
        """The next lease (``next_micro_batch()``); the caller releases it."""
        if self._interrupted.is_set():
            raise InterruptedError(f"{self.name} was interrupted")
        return self.next_micro_batch(cancel=self._interrupted)

    def next_lease(self, timeout_s: float) -> PackedMicroBatch:
        """``next()`` waiting at most ``timeout_s`` (then ``TimeoutError``): a CPU
        ``MicroBatchIterator`` takes each lease with it on the training loop's thread (NOTE
        [ Inline hand-out ] in knitkit/microbatch_iter/worker.py)."""
        if self._interrupted.is_set():
            raise InterruptedError(f"{self.name} was interrupted")
        return self.next_micro_batch(timeout_s, cancel=self._interrupted)

    def wake(self) -> None:
        """Make a ``next_micro_batch`` waiting in another thread look at its cancel event."""
        self._ring.wake_consumers()

    def take(self, count: int) -> ConsumerTake:
        """An iterator of exactly the next ``count`` leases: it never asks the ring for one more
        (the next ones may not be packable yet), raises if the producer finishes early, and
        closing it (a ``MicroBatchIterator`` over it does) leaves this consumer open."""
        if count < 0:
            raise ValueError(f"take({count}): the count must be >= 0")
        return ConsumerTake(self, count)

    def interrupt(self) -> None:
        """Make iteration (``next()``) waiting in another thread raise ``InterruptedError`` at
        once, and every later ``next()``; for an owner about to close the consumer (a
        ``MicroBatchIterator`` closing over it). ``take()`` iterators have their own."""
        self._interrupted.set()
        self._ring.wake_consumers()

    def metrics(self) -> dict[str, float]:
        """This consumer's figures, cumulative since it attached:

        - ``knitkit/delivery/consumer_wait_s``: seconds spent waiting for publications (in the
          prefetch thread under a ``MicroBatchIterator``: hidden behind compute if it kept up);
        - ``knitkit/delivery/decode_s``: seconds decoding layouts and building leases;
        - ``knitkit/delivery/handed_out``: micro-batches leased;
        - ``knitkit/delivery/handed_out_bytes``: their bytes;
        - ``knitkit/delivery/producer_bytes_read``: bytes its reorganizer read from storage (for
          the whole ring, every TP consumer's share);
        - ``knitkit/delivery/page_map_reads``: releases that read the page map for pages this
          process wrote (the others: no page fault since the slot was last clean, NOTE [ Written
          pages only after a fault ] in slot_ring.py);
        - ``knitkit/delivery/release_wakes``: releases that woke the producer, each a syscall (the
          others found it not waiting: NOTE [ Futex waits ] in atomic_words.py).
        """
        return {
            "knitkit/delivery/consumer_wait_s": self._wait_s,
            "knitkit/delivery/decode_s": self._decode_s,
            "knitkit/delivery/handed_out": float(self._handed_out),
            "knitkit/delivery/handed_out_bytes": float(self._handed_out_bytes),
            "knitkit/delivery/producer_bytes_read": float(self._ring.bytes_read),
            "knitkit/delivery/page_map_reads": float(self._ring.page_map_reads),
            "knitkit/delivery/release_wakes": float(self._ring.release_wakes),
        }

    def close(self) -> None:
        """Release every lease handed out, unmap the ring (never unlink it), free the index.

        Thread-safe and idempotent: a ``next_micro_batch()`` waiting in another thread raises
        ``ConsumerClosedError`` at once (a ``MicroBatchIterator`` over it reports that error);
        views of leases must not be used afterwards.
        """
        if self._closed:
            return
        self._closed = True
        self._ring.wake_consumers()
        left = self._busy.acquire(timeout=CLOSE_WAIT_S)
        try:
            if left:  # otherwise a wait is still inside the mapping: leave it mapped
                self._releases.release_all(self._next)
                self._detach()
        finally:
            if left:
                self._busy.release()

    def __enter__(self) -> MicroBatchConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_published(self, seq: int, timeout_s: float, cancel: threading.Event | None) -> None:
        ring = self._ring
        slices = _backing_off(timeout_s, self._liveness_timeout_s)
        while True:
            seen = ring.notified  # before the checks: an event after them changes it
            if ring.published > seq:
                return
            state = ring.state
            if state == FAILED:
                raise _failure(self.producer.name, ring.spec.name, ring.error())
            if state == DONE:
                if ring.published <= seq:
                    raise StopIteration
                return
            if self._closed:
                raise ConsumerClosedError(
                    f"{self.name} was closed while it waited for micro-batch {seq}"
                )
            if cancel is not None and cancel.is_set():
                raise InterruptedError(
                    f"{self.name}: the wait for micro-batch {seq} was interrupted"
                )
            if slices.check_due():  # see NOTE [ Liveness checks off the poll path ] in liveness.py
                self._check_alive(state)
                ring.check_size()
            if slices.expired:
                raise TimeoutError(self._timeout_message(seq, timeout_s))
            # NOTE [ Futex waits ] in atomic_words.py: announced, so a publication wakes it
            ring.wait_notified(seen, slices.slice_s(), self._index)

    def _timeout_message(self, seq: int, timeout_s: float) -> str:
        message = f"no micro-batch {seq} from ring {self._ring.spec.name!r} within {timeout_s} s"
        held = seq - self._releases.count
        if held >= self._ring.spec.num_slots:
            message += (
                f"; {self.name} holds {held} unreleased micro-batches and the ring has "
                f"{self._ring.spec.num_slots} slots: release each lease (`with lease:`)"
            )
        return message

    def _check_alive(self, state: int) -> None:
        check_producer(
            self._ring,
            self.producer,
            state,
            self._liveness_timeout_s,
            self._startup_deadline,
            before=f"before micro-batch {self._next}",
        )


def _backing_off(timeout_s: float, liveness_timeout_s: float) -> WaitSlices:
    """A rank's wait on a ring: checks after ``CHECK_EVERY_S``, then at doubling periods, at most
    a quarter of the liveness timeout apart (NOTE [ Liveness checks back off ] in liveness.py)."""
    quarter = liveness_timeout_s / 4
    return WaitSlices(
        timeout_s, min(CHECK_EVERY_S, quarter), longest_s=min(LONGEST_CHECK_S, quarter)
    )


def check_producer(
    ring: SlotRing,
    producer: Producer,
    state: int,
    liveness_timeout_s: float,
    startup_deadline: float,
    *,
    before: str,
) -> None:
    """Raise ``ReorganizerDiedError`` once ``ring``'s producer is gone (its role lock is free:
    NOTE [ Ring role locks ] in slot_ring.py), never started, or made no progress."""
    pid = abs(ring.producer_pid)  # a hint for people: it means nothing in another pid namespace
    where = f"{producer.name} of ring {ring.spec.name!r} (pid {pid or 'unknown'})"
    now = time.monotonic()
    if state == STARTING:
        if ring.exited_before_start or not ring.owner_alive or now > startup_deadline:
            raise ReorganizerDiedError(
                f"{where} never started (its process exited at start-up, its ring's owner "
                "is gone, or the start-up timeout passed); check its process for an error at "
                f"start-up; {producer.remedy}"
            )
        return
    if not ring.producer_alive:
        raise ReorganizerDiedError(f"{where} died {before}; {producer.remedy}")
    if now - ring.heartbeat > liveness_timeout_s:
        raise ReorganizerDiedError(
            f"{where} made no progress (heartbeat) for {now - ring.heartbeat:.1f} s "
            f"(liveness_timeout_s={liveness_timeout_s}): a read is stuck or the process "
            "is stopped"
        )


class ProducerWatch:
    """Watches a ring's producer without taking anything from the ring: for a process that
    waits on other rings but must stop once this ring's producer failed or died (a rank
    watching its driver's schedule while it waits on its data ring: NOTE [ Next pass per
    group ] in knitkit/job/serving.py). Its own read-only mapping, no role: it never moves a
    release count, and closing it leaves every consumer of the ring attached. Thread-safe.
    """

    def __init__(
        self,
        spec: RingSpec,
        *,
        producer: Producer,
        liveness_timeout_s: float = 30.0,
        startup_timeout_s: float = math.inf,
    ) -> None:
        self.producer = producer
        self._ring = SlotRing.attach(spec, read_only_slots=True)
        self._liveness_timeout_s = liveness_timeout_s
        self._startup_deadline = time.monotonic() + startup_timeout_s
        self._readers = 0
        """Calls reading the mapping now; ``close`` unmaps once none is left."""
        self._idle = threading.Condition()
        self._closed = False

    def wait(
        self,
        timeout_s: float,
        cancel: threading.Event,
        heartbeat: Callable[[], bool] = lambda: True,
    ) -> bool:
        """Block until the producer finished (``True``), or ``timeout_s`` passed or ``cancel``
        is set (``False``, also once closed); raise ``ReorganizerError`` (it failed, with its
        message) or ``ReorganizerDiedError`` (gone; or silent past ``liveness_timeout_s`` at a
        check where ``heartbeat()`` says its silence matters now)."""
        if not self._enter():
            return False
        try:
            ring = self._ring
            slices = _backing_off(timeout_s, self._liveness_timeout_s)
            while not (self._closed or cancel.is_set()):
                seen = ring.notified  # before the checks: an event after them changes it
                due = slices.check_due()
                if self._check(due, stale=due and heartbeat()):
                    return True
                if slices.expired:
                    return False
                ring.wait_notified(seen, slices.slice_s())  # NOTE [ Futex waits ]
            return False
        finally:
            self._leave()

    def check(self) -> None:
        """``wait``'s errors now, without waiting (nothing once closed)."""
        if self._enter():
            try:
                self._check(alive=True, stale=True)
            finally:
                self._leave()

    def close(self) -> None:
        """Make a ``wait`` in another thread return (it looks at once), then unmap once no call
        reads the mapping (within ``CLOSE_WAIT_S``; else it stays mapped); idempotent."""
        with self._idle:
            if self._closed:
                return
            self._closed = True
        self._ring.wake_consumers()
        with self._idle:
            if not self._idle.wait_for(lambda: self._readers == 0, CLOSE_WAIT_S):
                return
        self._ring.close()

    def _check(self, alive: bool, *, stale: bool) -> bool:
        """True once the producer finished; its failure, with ``alive`` its death, and with
        ``stale`` its silence past ``liveness_timeout_s`` raised."""
        ring = self._ring
        state = ring.state
        if state == FAILED:
            raise _failure(self.producer.name, ring.spec.name, ring.error())
        if state == DONE:
            return True
        if alive:  # NOTE [ Liveness checks off the poll path ]
            check_producer(
                ring,
                self.producer,
                state,
                self._liveness_timeout_s if stale else math.inf,
                self._startup_deadline,
                before="finishing",
            )
        return False

    def _enter(self) -> bool:
        with self._idle:
            if self._closed:
                return False
            self._readers += 1
            return True

    def _leave(self) -> None:
        with self._idle:
            self._readers -= 1
            self._idle.notify_all()


class LeaseSource(Protocol):
    """What a ``Take`` reads: a consumer handing out leases one at a time (``MicroBatchConsumer``,
    or one that follows its reorganizer across restarts)."""

    @property
    def name(self) -> str: ...

    def next_micro_batch(
        self, timeout_s: float | None = None, *, cancel: threading.Event
    ) -> PackedMicroBatch:
        """The next lease; a wait longer than ``timeout_s`` (default: the source's own bound)
        raises ``TimeoutError``."""
        ...

    def wake(self) -> None:
        """Make a ``next_micro_batch`` waiting in another thread look at its cancel event."""
        ...


class Take(Iterator[PackedMicroBatch]):
    """Exactly ``count`` leases from a consumer (``MicroBatchConsumer.take``); closing it ends
    it, interrupting a wait in another thread, and leaves the consumer open."""

    def __init__(self, consumer: LeaseSource, count: int) -> None:
        self._consumer = consumer
        self.count = count
        self.taken = 0
        self._cancel = threading.Event()
        self._ended = False
        """``_cancel``'s flag as a plain attribute: read per micro-batch without a call."""

    def __next__(self) -> PackedMicroBatch:
        return self._next(None)

    def _next(self, timeout_s: float | None) -> PackedMicroBatch:
        """The next lease, its wait bounded by ``timeout_s`` where the consumer takes one."""
        if self.taken >= self.count or self._ended:
            raise StopIteration
        try:  # the consumer's own call, not a method of this take's: one frame per hand-out
            lease = self._consumer.next_micro_batch(timeout_s, cancel=self._cancel)
        except StopIteration:
            raise RuntimeError(
                f"{self._consumer.name} finished after {self.taken} of the {self.count} "
                "micro-batches this take expects: the plan and the reorganizer disagree"
            ) from None
        self.taken += 1
        return lease

    def interrupt(self) -> None:
        """Make a ``next()`` waiting in another thread raise ``InterruptedError`` at once."""
        self._ended = True
        self._cancel.set()
        self._consumer.wake()

    def close(self) -> None:
        """End the take (``interrupt``); the consumer stays open."""
        self.interrupt()


class ConsumerTake(Take):
    """A ``MicroBatchConsumer``'s take: also hands out with a bound on the wait (``next_lease``),
    which a CPU ``MicroBatchIterator`` calls on the training loop's thread (NOTE [ Inline
    hand-out ] in knitkit/microbatch_iter/worker.py). A subclass of ``Take`` that overrides
    ``__next__`` (a job's checked take) gets no ``next_lease``, so its checks always run."""

    next_lease = Take._next
    """``next()`` waiting at most ``timeout_s`` (then ``TimeoutError``): ``_next`` itself, so
    an inline hand-out enters no frame of its own here (NOTE [ Lease in few calls ])."""
