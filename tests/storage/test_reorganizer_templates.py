"""A reorganizer builds its pack and record templates once per field set for the whole job,
not once per assignment, and rebuilds them when the schema changes (NOTE [ Pack templates ])."""

from __future__ import annotations

import threading

from delivery_payloads import ROUTING_ROW, fill_backend, make_metas, plan_for

from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer import Reorganizer
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.storage.planning.plan import Topology


def test_templates_outlive_an_assignment_while_the_schema_holds() -> None:
    """Three assignments of one field set publish with the same template objects (on 30f28cf
    every assignment built them again, ~60 us each, per reorganizer and step); a plan whose
    schema gives a known field another dtype makes the reorganizer drop them."""
    metas = make_metas([37, 5, 91, 12])
    backend = MemoryBackend()
    fill_backend(backend, metas)
    plans = [plan_for(metas, Topology(1, 1, 1), 64, f"mb{i}") for i in range(3)]
    schema = {
        "tokens": ("int32", ()),
        "logprobs": ("float32", ()),
        "routing": ("uint8", ROUTING_ROW),
        "reward": ("float32", ()),
    }
    plans = [plan.with_schema(schema) for plan in plans]
    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 18, num_consumers=1)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    consumer = MicroBatchConsumer(spec, 0)
    reorganizer = Reorganizer(backend, publisher)
    seen: list[list[object]] = []  # the objects themselves: a freed one's id can come back

    def produce() -> None:
        for plan in plans:
            reorganizer.deliver(plan.minibatch_id, plan.consumer(0, 0))
            seen.append([t for pair in reorganizer._packers.values() for t in pair])

    thread = threading.Thread(target=produce)
    thread.start()
    try:
        for plan in plans:
            for _ in plan.consumer(0, 0).micro_batches:
                consumer.next_micro_batch(timeout_s=30).release()
        thread.join(30)
        assert len(seen) == 3 and seen[0], seen
        for later in seen[1:]:
            assert all(a is b for a, b in zip(seen[0], later, strict=True)), "rebuilt"
        widened = plans[0].with_schema({**schema, "tokens": ("int64", ())}).consumer(0, 0)
        assert reorganizer._learn_schema(widened) is True
        assert reorganizer._learn_schema(plans[0].consumer(0, 0)) is True  # and back
        assert reorganizer._learn_schema(plans[1].consumer(0, 0)) is False
    finally:
        thread.join(30)
        consumer.close()
        publisher.close()
        owner.request_stop()
        owner.close()
        owner.unlink()
