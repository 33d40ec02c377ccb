"""A rank's waits on its ring cost no wakes they do not need: a publication wakes a consumer only
while it sleeps for one, and a long wait checks its producer's liveness at backing-off periods
(issue 31; NOTE [ Futex waits ] in knitkit/storage/delivery/atomic_words.py, NOTE [ Liveness
checks back off ] in knitkit/storage/delivery/liveness.py)."""

from __future__ import annotations

import threading
import time

import pytest
from ring_parts import BOUND_S, published_ring

from knitkit.storage.delivery.liveness import WaitSlices
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.types import MicroBatchLayout, PackedMicroBatch

LAYOUT = MicroBatchLayout.build({"x": ("int64", (64,))})


def _publish(publisher: Publisher) -> None:
    publisher.acquire(LAYOUT.nbytes)
    publisher.publish(LAYOUT)


def test_publications_make_no_wake_while_no_consumer_sleeps() -> None:
    """Consumers busy elsewhere (none waits for a micro-batch): the producer publishes without a
    wake syscall, and every micro-batch is still handed out to every consumer."""
    spec = RingSpec.new(num_slots=8, slot_bytes=4096, num_consumers=2)
    with published_ring(spec) as ring:
        for _ in range(6):
            _publish(ring.publisher)
        assert ring.publisher.ring.publish_wakes == 0
        for consumer in ring.consumers:
            seqs = []
            for _ in range(6):
                with consumer.next_micro_batch(timeout_s=BOUND_S) as lease:
                    seqs.append(lease.seq)
            assert seqs == list(range(6))


def test_a_consumer_sleeping_for_a_publication_is_woken_by_it() -> None:
    """A consumer that announced its sleep gets the micro-batch it waits for, with one wake (or
    none, where the publication fell between its look and its sleep): no lost wake-up."""
    spec = RingSpec.new(num_slots=2, slot_bytes=4096, num_consumers=2)
    with published_ring(spec) as ring:
        got: list[PackedMicroBatch] = []
        waiter = threading.Thread(
            target=lambda: got.append(ring.consumers[1].next_micro_batch(timeout_s=BOUND_S)),
            daemon=True,
        )
        waiter.start()
        deadline = time.monotonic() + BOUND_S
        while not ring.owner.consumer_waits(1):  # it sleeps, announced
            assert time.monotonic() < deadline, "consumer 1 never slept on NOTIFY"
            time.sleep(0.001)
        assert not ring.owner.consumer_waits(0)
        _publish(ring.publisher)
        waiter.join(BOUND_S)
        assert not waiter.is_alive() and got[0].seq == 0
        assert ring.publisher.ring.publish_wakes <= 1
        assert not ring.owner.consumer_waits(1)  # withdrawn after the sleep
        got[0].release()


def test_a_long_wait_checks_liveness_at_backing_off_periods(monkeypatch) -> None:
    """A consumer waiting 1.6 s on a live producer that publishes nothing checks its liveness
    (a lock probe) after 0.25 s and then at doubling periods: 2 or 3 checks, not one per 0.25 s
    (6); and still times out with TimeoutError."""
    calls = []
    probe = SlotRing.producer_alive.fget
    assert probe is not None

    def counted(ring: SlotRing) -> bool:
        calls.append(time.monotonic())
        return probe(ring)

    monkeypatch.setattr(SlotRing, "producer_alive", property(counted))
    spec = RingSpec.new(num_slots=2, slot_bytes=4096, num_consumers=1)
    with published_ring(spec) as ring:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            ring.consumers[0].next_micro_batch(timeout_s=1.6)
        waited = time.monotonic() - start
    assert 1 <= len(calls) <= 3, (len(calls), waited)
    assert calls[0] - start >= 0.2  # a short wait makes no check at all


def test_wait_slices_back_off_up_to_the_longest_period() -> None:
    """``longest_s``: the period doubles after each check and stops at ``longest_s``, and no
    slice sleeps past the next check; without it the period stays fixed."""
    slices = WaitSlices(check_every_s=0.01, longest_s=0.04)
    checks = []
    deadline = time.monotonic() + BOUND_S
    while len(checks) < 6:
        assert slices.slice_s() <= 0.04 + 1e-6
        if slices.check_due():
            checks.append(slices._every)
        assert time.monotonic() < deadline
    assert checks == [0.02, 0.04, 0.04, 0.04, 0.04, 0.04]
    fixed = WaitSlices(check_every_s=0.01)
    while not fixed.check_due():
        assert time.monotonic() < deadline
    assert fixed._every == 0.01
