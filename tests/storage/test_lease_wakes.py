"""A release wakes the producer only while it sleeps and only once every consumer released the slot
it waits for: no futex syscall per release otherwise, and no lost wake-up (issue 31; NOTE
[ Futex waits ] in knitkit/storage/delivery/atomic_words.py)."""

from __future__ import annotations

import threading
import time

from ring_parts import BOUND_S, published_ring

from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import _PRODUCER_WAITS_W as PRODUCER_WAITS_W
from knitkit.storage.delivery.slot_ring import RingSpec
from knitkit.types import MicroBatchLayout

WAKES = "knitkit/delivery/release_wakes"
LAYOUT = MicroBatchLayout.build({"x": ("int64", (64,))})


def _publish(publisher: Publisher) -> None:
    publisher.acquire(LAYOUT.nbytes)
    publisher.publish(LAYOUT)


def test_releases_make_no_wake_while_the_producer_does_not_wait() -> None:
    """A ring with room for every micro-batch: the producer never sleeps, so none of the
    releases makes a wake syscall."""
    spec = RingSpec.new(num_slots=8, slot_bytes=4096, num_consumers=2)
    with published_ring(spec) as ring:
        owner, publisher, consumers = ring.owner, ring.publisher, ring.consumers
        for _ in range(6):
            _publish(publisher)
        for consumer in consumers:
            for _ in range(6):
                consumer.next_micro_batch(timeout_s=BOUND_S).release()
            assert consumer.metrics()[WAKES] == 0
        assert owner.released(0) == owner.released(1) == 6


def test_a_producer_sleeping_on_a_full_ring_is_woken_by_the_release_it_waits_for() -> None:
    """The producer blocks on a full ring waiting for consumer 1 (the one that released least);
    consumer 0's release does not wake it (it does not wait on consumer 0), consumer 1's release
    does, with one wake, and the producer goes on to publish into the freed slot."""
    spec = RingSpec.new(num_slots=1, slot_bytes=4096, num_consumers=2)
    with published_ring(spec) as ring:
        owner, publisher, consumers = ring.owner, ring.publisher, ring.consumers
        _publish(publisher)
        leases = [consumer.next_micro_batch(timeout_s=BOUND_S) for consumer in consumers]
        leases[0].release()
        second = threading.Thread(target=_publish, args=(publisher,), daemon=True)
        second.start()
        deadline = time.monotonic() + BOUND_S
        while owner.producer_waits_on != 1:  # the producer sleeps on consumer 1's count
            assert time.monotonic() < deadline, "the producer never waited for consumer 1"
            time.sleep(0.001)
        assert consumers[0].metrics()[WAKES] == 0
        leases[1].release()
        # one wake, or none where the release fell between two of the producer's wait slices
        # (it then finds the new count itself): what must hold is that it is never lost
        assert consumers[1].metrics()[WAKES] <= 1
        second.join(BOUND_S)
        assert not second.is_alive() and owner.published == 2
        assert owner.producer_waits_on is None


def test_a_release_wakes_exactly_when_the_producer_announces_it_sleeps_on_that_consumer() -> None:
    """The consumer's side of the handshake alone, with the producer's word set by hand on a
    full ring: a release wakes (one syscall, the announced consumer's word) only while the
    producer announces a wait and only once every consumer released the slot it waits for, so
    the announced consumer releasing first makes no wake and the last one does (on 62f8166 the
    announced consumer woke it while its peer still held the slot)."""
    spec = RingSpec.new(num_slots=2, slot_bytes=4096, num_consumers=2)
    with published_ring(spec) as ring:
        owner, publisher, consumers = ring.owner, ring.publisher, ring.consumers
        for _ in range(2):
            _publish(publisher)
        for announced, order, wakes in ((0, (0, 1), (0, 1)), (None, (1, 0), (0, 1))):
            owner.words[PRODUCER_WAITS_W] = 0 if announced is None else announced + 1
            for index in order:
                consumers[index].next_micro_batch(timeout_s=BOUND_S).release()
            assert tuple(c.metrics()[WAKES] for c in consumers) == wakes, announced
            owner.words[PRODUCER_WAITS_W] = 0
            _publish(publisher)
