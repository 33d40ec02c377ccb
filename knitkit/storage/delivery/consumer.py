"""Consumer side of micro-batch publication: the next packed micro-batch as zero-copy views."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from functools import partial

from knitkit.storage.delivery.liveness import Backoff, pid_alive
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
    ):
        """Attach as TP consumer ``consumer_index``; see NOTE [ Micro-batch publication protocol ].

        ``liveness_timeout_s``: a producer that makes no progress this long counts as dead.
        ``wait_timeout_s``: the default bound of ``next_micro_batch`` (``math.inf`` to wait
        while the producer lives, e.g. for a mini-batch that is still being generated).
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
        self._next = self._ring.released(consumer_index)
        self._released = self._next
        self._early_releases: set[int] = set()
        self._current: PackedMicroBatch | None = None

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
        timeout_s = self._wait_timeout_s if timeout_s is None else timeout_s
        seq = self._next
        if self._ring.published <= seq:  # the usual look-ahead case skips the wait's set-up
            self._wait_published(seq, timeout_s)
        layout = self._ring.read_meta(seq)
        buffer = self._ring.slot(seq, layout.nbytes).toreadonly()
        self._next += 1
        return PackedMicroBatch(layout, buffer, partial(self._release, seq), seq)

    def __iter__(self) -> Iterator[PackedMicroBatch]:
        return self

    def __next__(self) -> PackedMicroBatch:
        if self._current is not None:
            self._current.release()
        self._current = self.next_micro_batch()
        return self._current

    def close(self) -> None:
        """Release what this consumer still holds and unmap the ring (never unlinks it)."""
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

    def _release(self, seq: int) -> None:
        self._early_releases.add(seq)
        while self._released in self._early_releases:
            self._early_releases.remove(self._released)
            self._released += 1
        self._ring.set_released(self._index, self._released)

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
