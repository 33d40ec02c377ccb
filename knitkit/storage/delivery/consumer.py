"""Consumer side of micro-batch publication: the next packed micro-batch as zero-copy views."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from knitkit.storage.delivery.liveness import Backoff, pid_alive
from knitkit.storage.delivery.slot_ring import (
    DONE,
    FAILED,
    STARTING,
    RingSpec,
    SlotRing,
)
from knitkit.types import MicroBatchLayout


class ReorganizerError(RuntimeError):
    """The reorganizer feeding this consumer failed; the message carries its error."""


class ReorganizerDiedError(RuntimeError):
    """The reorganizer feeding this consumer died (or stopped beating) before finishing."""


@dataclass(slots=True)
class DeliveredMicroBatch:
    """One published micro-batch: read-only views into its ring slot, valid until ``release()``."""

    seq: int
    """Sequence number in the ring (counts micro-batches across mini-batches)."""
    layout: MicroBatchLayout
    buffer: memoryview
    """The slot's first ``layout.nbytes`` bytes (read-only): one flat copy moves the micro-batch."""
    fields: dict[str, np.ndarray]
    _consumer: MicroBatchConsumer = field(repr=False)
    released: bool = False

    def release(self) -> None:
        """Hand the slot back; the views must not be used afterwards."""
        if not self.released:
            self.released = True
            self._consumer._release(self.seq)


class MicroBatchConsumer:
    """One TP rank's handle on its (DP, CP) group's slot ring (see NOTE in publication.py).

    ``next_micro_batch()`` returns micro-batches in publication order; the caller releases each
    (in any order; the slot frees once every earlier one is released too). Iterating the consumer
    releases each micro-batch when the next one is requested.
    """

    def __init__(
        self,
        spec: RingSpec,
        consumer_index: int,
        *,
        liveness_timeout_s: float = 5.0,
        startup_timeout_s: float = 120.0,
    ):
        if not 0 <= consumer_index < spec.num_consumers:
            raise ValueError(
                f"consumer_index={consumer_index} outside ring {spec.name!r}'s "
                f"{spec.num_consumers} consumers"
            )
        self._ring = SlotRing.attach(spec)
        self._index = consumer_index
        self._liveness_timeout_s = liveness_timeout_s
        self._startup_deadline = time.monotonic() + startup_timeout_s
        self._next = self._ring.released(consumer_index)
        self._released = self._next
        self._early_releases: set[int] = set()
        self._current: DeliveredMicroBatch | None = None

    @property
    def producer_bytes_read(self) -> int:
        """Bytes the reorganizer read from storage so far (for accounting)."""
        return self._ring.bytes_read

    def next_micro_batch(self, timeout_s: float | None = None) -> DeliveredMicroBatch:
        """Wait for the next published micro-batch; ``StopIteration`` when the producer is done.

        Raises ``ReorganizerError`` if the producer failed, ``ReorganizerDiedError`` if it died,
        ``TimeoutError`` if ``timeout_s`` passes while it is alive but has published nothing new.
        """
        seq = self._next
        self._wait_published(seq, timeout_s)
        layout = self._ring.read_meta(seq)
        buffer = self._ring.slot(seq, layout.nbytes).toreadonly()
        self._next += 1
        return DeliveredMicroBatch(seq, layout, buffer, layout.numpy_views(buffer), self)

    def __iter__(self) -> Iterator[DeliveredMicroBatch]:
        return self

    def __next__(self) -> DeliveredMicroBatch:
        if self._current is not None:
            self._current.release()
        self._current = self.next_micro_batch()
        return self._current

    def close(self) -> None:
        """Release what this consumer still holds and unmap the ring (never unlinks it)."""
        if self._current is not None:
            self._current.release()
            self._current = None
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

    def _wait_published(self, seq: int, timeout_s: float | None) -> None:
        ring = self._ring
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        backoff = Backoff()
        while ring.published <= seq:
            state = ring.state
            if state == FAILED:
                raise ReorganizerError(f"reorganizer of ring {ring.spec.name!r}: {ring.error()}")
            if state == DONE:
                if ring.published <= seq:
                    raise StopIteration
                break
            self._check_alive(state)
            if deadline is not None and time.monotonic() > deadline:
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
                f"reorganizer pid {pid} of ring {ring.spec.name!r} missed its heartbeat for "
                f"{now - ring.heartbeat:.1f} s (liveness_timeout_s={self._liveness_timeout_s})"
            )
