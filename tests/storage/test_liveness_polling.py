"""Polling loops keep liveness checks (``/proc`` reads) off the per-poll path."""

from __future__ import annotations

import time

import pytest

from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.liveness import WaitSlices
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing


def test_wait_slices_check_is_due_once_per_period() -> None:
    """check_due() is False during the first period of waiting, then True at most once per
    period, and no slice sleeps past the next check (see NOTE [ Liveness checks off the poll
    path ])."""
    backoff = WaitSlices(check_every_s=0.05)
    assert backoff.slice_s() <= 0.05
    assert not backoff.check_due()
    deadline = time.monotonic() + 30
    while not backoff.check_due():
        assert time.monotonic() < deadline
    assert not backoff.check_due()


def test_waiting_consumer_checks_liveness_per_period_not_per_poll(monkeypatch) -> None:
    """A consumer waiting 0.3 s on a live producer checks its liveness (a lock probe, NOTE [ Ring
    role locks ]) about once per liveness period (at most once per 10 ms), not once per wake, and
    still times out with TimeoutError."""
    calls = []
    probe = SlotRing.producer_alive.fget
    assert probe is not None

    def counted(ring: SlotRing) -> bool:
        calls.append(ring)
        return probe(ring)

    monkeypatch.setattr(SlotRing, "producer_alive", property(counted))
    spec = RingSpec.new(num_slots=2, slot_bytes=64, num_consumers=1)
    ring = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    consumer = MicroBatchConsumer(spec, 0)
    try:
        calls.clear()
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            consumer.next_micro_batch(timeout_s=0.3)
        waited = time.monotonic() - start
        assert len(calls) <= waited / 0.01 + 1, (len(calls), waited)
    finally:
        consumer.close()
        publisher.close()
        ring.close()
        ring.unlink()
