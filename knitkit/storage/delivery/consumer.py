"""Consumer side of micro-batch publication: the next packed micro-batch as zero-copy views."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterator
from functools import partial

from knitkit.storage.backends.segments import pid_alive
from knitkit.storage.delivery.liveness import Backoff
from knitkit.storage.delivery.slot_ring import (
    DONE,
    FAILED,
    STARTING,
    RingSpec,
    SlotRing,
)
from knitkit.types import PackedMicroBatch


class ReorganizerError(RuntimeError):
    """The reorganizer feeding this consumer failed; the message carries its error."""


class ReorganizerDiedError(RuntimeError):
    """The reorganizer feeding this consumer died (or stopped beating) before finishing."""


# NOTE [ Decode-ahead ]
#
# A consumer asks for its next micro-batch right after computing on the previous one, when its
# caches hold the compute's working set, not ours: decoding the slot's layout and slicing the slot
# then takes 100-200 us instead of the 25 us it takes warm (benchmarks/transfer.py, look-ahead
# regime), several times per step, on the critical path. The slot of micro-batch s+1 is
# normally published while the consumer still computes on s, so a daemon thread of the consumer
# (`_DecodeAhead`) does that work then: each hand-out asks it for the next sequence number; it
# waits (polling, at most `DECODE_AHEAD_PATIENCE_S`, so an idle trainer is not polled forever)
# until that micro-batch is published, decodes its layout and slices its slot. The consumer uses
# the result only if it is for exactly the sequence number it wants, otherwise (not ready yet,
# or stale) it decodes itself, as without the thread: the slot of a micro-batch the consumer has
# not taken cannot be reused, so a result for the wanted number is never torn, and a stale or
# failed decode is dropped (the consumer's own decode raises any error). The thread holds no
# reference to the consumer, stops on `close()` or when the consumer is garbage-collected, and
# costs the training loop the GIL for one decode per micro-batch, during compute;
# `decode_ahead=False` turns it off.

DECODE_AHEAD_PATIENCE_S = 0.5
"""How long the decode-ahead thread polls for a micro-batch not yet published before it leaves
the wait to the consumer's own call (NOTE [ Decode-ahead ])."""


class _Releases:
    """A consumer's release count: ``RELEASED[c]`` moves to ``s + 1`` once ``s`` and every
    micro-batch before it were released (in any order). Kept apart from the consumer so the
    decode-ahead thread can build hand-outs without holding the consumer alive."""

    def __init__(self, ring: SlotRing, index: int):
        self._ring = ring
        self._index = index
        self._released = ring.released(index)
        self._early: set[int] = set()

    def release(self, seq: int) -> None:
        self._early.add(seq)
        while self._released in self._early:
            self._early.remove(self._released)
            self._released += 1
        self._ring.set_released(self._index, self._released)


def _hand_out(ring: SlotRing, releases: _Releases, seq: int) -> PackedMicroBatch:
    """Published micro-batch ``seq`` as read-only views over its slot."""
    layout = ring.read_meta(seq)
    buffer = ring.slot(seq, layout.nbytes).toreadonly()
    return PackedMicroBatch(layout, buffer, partial(releases.release, seq), seq)


class _DecodeAhead:
    """The decode-ahead thread of one consumer (NOTE [ Decode-ahead ])."""

    def __init__(self, ring: SlotRing, releases: _Releases, first: int):
        self._ring = ring
        self._releases = releases
        self.want = first
        self.ready: PackedMicroBatch | None = None
        self._closing = False
        self._kick = threading.Lock()  # held while there is nothing to do; released to wake
        self._kick.acquire()
        self._thread = threading.Thread(
            target=self._run, name=f"knitkit-decode-ahead-{ring.spec.name}", daemon=True
        )
        self._thread.start()
        self.request(first)

    def request(self, seq: int) -> None:
        """Prepare ``seq`` next (wakes the thread; cheap enough for every hand-out)."""
        self.want = seq
        if self._kick.locked():  # only the consumer releases it, only the thread takes it
            self._kick.release()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; it never blocks for longer than one poll or one decode."""
        self._closing = True
        if self._kick.locked():
            self._kick.release()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._kick.acquire()
            if self._closing:
                return
            want = self.want
            try:
                if self._wait_published(want):
                    self.ready = _hand_out(self._ring, self._releases, want)
            except Exception:  # dropped: the consumer's own decode raises it, with context
                continue

    def _wait_published(self, want: int) -> bool:
        ring = self._ring
        deadline = time.monotonic() + DECODE_AHEAD_PATIENCE_S
        backoff = Backoff()
        while ring.published <= want:
            if self._closing or self.want != want or ring.state in (DONE, FAILED):
                return False
            if time.monotonic() > deadline:
                return False
            backoff.wait()
        return True


class MicroBatchConsumer:
    """One TP rank's handle on its (DP, CP) group's slot ring (see NOTE [ Micro-batch publication protocol ] in publication.py).

    ``next_micro_batch()`` returns micro-batches in publication order, each a ``PackedMicroBatch``
    over the slot's first ``layout.nbytes`` bytes (read-only; ``seq`` counts micro-batches across
    mini-batches), valid until ``release()``; the caller releases each
    (in any order; the slot frees once every earlier one is released too). Iterating the consumer
    releases each micro-batch when the next one is requested.
    """

    def __init__(
        self,
        spec: RingSpec,
        consumer_index: int,
        *,
        liveness_timeout_s: float = 30.0,
        startup_timeout_s: float = 120.0,
        wait_timeout_s: float = 600.0,
        decode_ahead: bool = True,
    ):
        """Attach as TP consumer ``consumer_index``; see NOTE [ Micro-batch publication protocol ].

        ``liveness_timeout_s``: a producer that makes no progress this long counts as dead.
        ``wait_timeout_s``: the default bound of ``next_micro_batch`` (``math.inf`` to wait
        while the producer lives, e.g. for a mini-batch that is still being generated).
        ``decode_ahead``: decode each next micro-batch's layout in a background thread while the
        caller computes (NOTE [ Decode-ahead ]).
        """
        if not 0 <= consumer_index < spec.num_consumers:
            raise ValueError(
                f"consumer_index={consumer_index} outside ring {spec.name!r}'s "
                f"{spec.num_consumers} consumers"
            )
        self._ring = SlotRing.attach(spec)
        holder = self._ring.consumer_pid(consumer_index)
        if holder not in (0, os.getpid()) and pid_alive(holder):
            self._ring.close()
            raise ValueError(
                f"consumer_index={consumer_index} of ring {spec.name!r} is attached by live pid "
                f"{holder}; each TP rank attaches with its own index"
            )
        self._ring.set_consumer_pid(consumer_index, os.getpid())
        self._index = consumer_index
        self._wait_timeout_s = wait_timeout_s
        self._liveness_timeout_s = liveness_timeout_s
        self._startup_deadline = time.monotonic() + startup_timeout_s
        self._releases = _Releases(self._ring, consumer_index)
        self._next = self._ring.released(consumer_index)
        self._current: PackedMicroBatch | None = None
        self._ahead = _DecodeAhead(self._ring, self._releases, self._next) if decode_ahead else None
        self._stop_ahead = weakref.finalize(self, self._ahead.stop) if self._ahead else None
        self.decoded_ahead = 0
        """Micro-batches handed out whose layout the decode-ahead thread had ready."""

    @property
    def producer_bytes_read(self) -> int:
        """Bytes the reorganizer read from storage so far (for accounting)."""
        return self._ring.bytes_read

    def next_micro_batch(self, timeout_s: float | None = None) -> PackedMicroBatch:
        """Wait for the next published micro-batch; ``StopIteration`` when the producer is done.

        Raises ``ReorganizerError`` if the producer failed, ``ReorganizerDiedError`` if it died
        or made no progress for ``liveness_timeout_s``, ``TimeoutError`` if ``timeout_s``
        (default: the consumer's ``wait_timeout_s``) passes while it lives and published nothing.
        """
        seq = self._next
        ahead = self._ahead
        batch = ahead.ready if ahead is not None else None
        if batch is not None and batch.seq == seq:
            self.decoded_ahead += 1
        else:
            if self._ring.published <= seq:  # the usual look-ahead case skips the wait's set-up
                self._wait_published(seq, self._wait_timeout_s if timeout_s is None else timeout_s)
            batch = _hand_out(self._ring, self._releases, seq)
        self._next = seq + 1
        if ahead is not None:
            ahead.request(seq + 1)
        return batch

    def __iter__(self) -> Iterator[PackedMicroBatch]:
        return self

    def __next__(self) -> PackedMicroBatch:
        if self._current is not None:
            self._current.release()
        self._current = self.next_micro_batch()
        return self._current

    def close(self) -> None:
        """Release what this consumer still holds and unmap the ring (never unlinks it)."""
        if self._stop_ahead is not None:
            self._stop_ahead()  # once: stops and joins the thread
            self._ahead = None
        if self._current is not None:
            self._current.release()
            self._current = None
        if self._ring.consumer_pid(self._index) == os.getpid():
            self._ring.set_consumer_pid(self._index, 0)
        self._ring.close()

    def __enter__(self) -> MicroBatchConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_published(self, seq: int, timeout_s: float) -> None:
        ring = self._ring
        deadline = time.monotonic() + timeout_s
        backoff = Backoff()
        while ring.published <= seq:
            state = ring.state
            if state == FAILED:
                raise ReorganizerError(f"reorganizer of ring {ring.spec.name!r}: {ring.error()}")
            if state == DONE:
                if ring.published <= seq:
                    raise StopIteration
                break
            if backoff.check_due():  # see NOTE [ Liveness checks off the poll path ] in liveness.py
                self._check_alive(state)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no micro-batch {seq} from ring {ring.spec.name!r} within {timeout_s} s"
                )
            backoff.wait()

    def _check_alive(self, state: int) -> None:
        ring = self._ring
        pid = ring.producer_pid
        now = time.monotonic()
        if state == STARTING:
            if (pid and not pid_alive(pid)) or now > self._startup_deadline:
                raise ReorganizerDiedError(
                    f"reorganizer of ring {ring.spec.name!r} (pid {pid or 'unknown'}) never "
                    "started; check its process for an error at start-up"
                )
            return
        if not pid_alive(pid):
            raise ReorganizerDiedError(
                f"reorganizer pid {pid} of ring {ring.spec.name!r} died before micro-batch "
                f"{self._next}; restart the mini-batch's reorganizers"
            )
        if now - ring.heartbeat > self._liveness_timeout_s:
            raise ReorganizerDiedError(
                f"reorganizer pid {pid} of ring {ring.spec.name!r} made no progress (heartbeat) "
                f"for {now - ring.heartbeat:.1f} s (liveness_timeout_s="
                f"{self._liveness_timeout_s}): a read is stuck or the process is stopped"
            )
