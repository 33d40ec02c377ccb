"""A ring with its publisher and consumers, for the tests of the lease path."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing

BOUND_S = 60.0
"""Every wait's bound: generous, a loaded machine must not fail these tests."""


@dataclass(slots=True)
class RingParts:
    owner: SlotRing
    publisher: Publisher
    consumers: list[MicroBatchConsumer]


@contextlib.contextmanager
def published_ring(spec: RingSpec) -> Iterator[RingParts]:
    """``spec``'s ring, created; a started publisher; every consumer attached. All of it closed
    and the ring unlinked afterwards."""
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    consumers: list[MicroBatchConsumer] = []
    try:
        for index in range(spec.num_consumers):
            consumers.append(MicroBatchConsumer(spec, index, liveness_timeout_s=BOUND_S))
        yield RingParts(owner, publisher, consumers)
    finally:
        for consumer in consumers:
            consumer.close()
        owner.request_stop()
        publisher.close()
        owner.close()
        owner.unlink()


def until_producer_waits(ring: SlotRing, bound_s: float = BOUND_S) -> None:
    """Poll until ``ring``'s producer sleeps for a slot (a consumer holds the one it needs)."""
    deadline = time.monotonic() + bound_s
    while ring.producer_waits_on is None:
        assert time.monotonic() < deadline, "the producer never waited for a slot"
        time.sleep(0.01)
