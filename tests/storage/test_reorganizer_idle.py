"""An idle reorganizer process costs little: one wake per heartbeat period (NOTE [ Reorganizer process shutdown ])."""

from __future__ import annotations

import glob
import time

import pytest

from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import HEARTBEAT_S, STARTING, RingSpec

LIVENESS_S = 1.0


def _wakes(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid`` so far (one per blocking wait)."""
    total = 0
    for status in glob.glob(f"/proc/{pid}/task/*/status"):
        with open(status) as lines:
            for line in lines:
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def test_an_idle_reorganizer_wakes_once_per_heartbeat_period() -> None:
    """A reorganizer process waiting for its next assignment wakes once per heartbeat period,
    for its owner check and its beat together (a heartbeat thread beside a 0.2 s poll woke it
    9 times a second, ~0.1 ms of CPU each, on every idle reorganizer of a job), and its
    heartbeat keeps a waiting consumer's liveness check content: the consumer's bounded wait
    ends in TimeoutError, not ReorganizerDiedError."""
    backend = SharedMemoryBackend(slab_bytes=1 << 16)
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 12, num_consumers=1)
    try:
        with ReorganizerProcess(backend, spec) as reorganizer:
            pid = reorganizer.pid
            assert pid is not None
            with MicroBatchConsumer(spec, 0, liveness_timeout_s=LIVENESS_S) as consumer:
                deadline = time.monotonic() + 60
                while reorganizer.ring.state == STARTING and time.monotonic() < deadline:
                    time.sleep(0.05)  # the child's start-up (imports): polled, not a fixed wait
                before, start = _wakes(pid), time.monotonic()
                with pytest.raises(TimeoutError):
                    consumer.next_micro_batch(timeout_s=1.2 * LIVENESS_S)
                wakes, elapsed = _wakes(pid) - before, time.monotonic() - start
        assert wakes <= elapsed / HEARTBEAT_S + 3, f"{wakes} wakes in {elapsed:.2f} s idle"
    finally:
        backend.close()
