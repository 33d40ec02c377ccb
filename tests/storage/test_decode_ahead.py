"""The consumer's decode-ahead thread (NOTE [ Decode-ahead ] in consumer.py): it prepares the next
micro-batch while the caller computes, hands out exactly what the plain path hands out, and
never outlives its consumer."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.types import MicroBatchLayout

POLL_BOUND_S = 60.0
"""Generous bound for a poll on a loaded machine."""


@pytest.fixture
def ring():
    """A 2-slot ring for 2 consumers, its owner, and a started publisher."""
    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 16, num_consumers=2)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    yield spec, publisher
    publisher.close()
    owner.close()
    owner.unlink()


def _publish(publisher: Publisher, value: int) -> int:
    rows = 1 + value % 7
    layout = MicroBatchLayout.build(
        {"x": ("int64", (rows,)), "y": ("float32", (rows, 3))}, extra={"value": value}
    )
    views = layout.numpy_views(publisher.acquire(layout.nbytes))
    views["x"][:] = np.arange(rows) + value
    views["y"][:] = value / 3
    return publisher.publish(layout)


def _poll(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + POLL_BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _decode_ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("knitkit-decode-ahead-")]


def _ready_seq(consumer: MicroBatchConsumer) -> int | None:
    ready = consumer._ahead.ready if consumer._ahead is not None else None
    return None if ready is None else ready.seq


def test_a_computing_consumer_gets_every_micro_batch_decoded_ahead():
    """Micro-batches published ahead of a consumer that computes between them: the thread has
    each one ready before it is asked for, and hands out the published bytes."""
    spec = RingSpec.new(num_slots=8, slot_bytes=1 << 16, num_consumers=1)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    for value in range(8):
        _publish(publisher, value)
    consumer = MicroBatchConsumer(spec, 0)
    for value in range(8):
        _poll(lambda value=value: _ready_seq(consumer) == value, f"decode of {value}")
        batch = consumer.next_micro_batch(timeout_s=POLL_BOUND_S)
        assert batch.seq == value and batch.layout.extra["value"] == value
        assert batch.fields["x"].tolist() == list(range(value, value + 1 + value % 7))
        assert batch.fields["y"].tolist() == [[np.float32(value / 3)] * 3] * (1 + value % 7)
        batch.release()
    assert consumer.decoded_ahead == 8
    consumer.close()
    publisher.close()
    owner.close()
    owner.unlink()


def test_decode_ahead_hands_out_what_the_plain_path_hands_out(ring):
    """Random compute times (none, short, longer than publication) and out-of-order releases:
    a decode-ahead consumer and a plain one see the same micro-batches, in order, byte for byte,
    and the ring moves on (no slot is held or freed twice)."""
    spec, publisher = ring
    count = 60

    def produce(rng: random.Random) -> None:
        for value in range(count):
            _publish(publisher, value)
            time.sleep(rng.choice((0.0, 0.0, 0.001)))
        publisher.finish()

    def consume(consumer: MicroBatchConsumer, rng: random.Random, out: list) -> None:
        held = []
        for _ in range(count):
            batch = consumer.next_micro_batch(timeout_s=POLL_BOUND_S)
            out.append((batch.seq, bytes(batch.buffer)))
            held.append(batch)
            time.sleep(rng.choice((0.0, 0.0005, 0.003)))
            if len(held) == 2:  # now and then the newer one first
                for done in held[:: rng.choice((1, -1))]:
                    done.release()
                held.clear()
        for done in held:
            done.release()

    consumers = [MicroBatchConsumer(spec, 0), MicroBatchConsumer(spec, 1, decode_ahead=False)]
    seen: list[list[tuple[int, bytes]]] = [[], []]
    threads = [threading.Thread(target=produce, args=(random.Random(0),))]
    threads += [
        threading.Thread(target=consume, args=(c, random.Random(i + 1), seen[i]))
        for i, c in enumerate(consumers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(POLL_BOUND_S)
        assert not thread.is_alive()
    assert [seq for seq, _ in seen[0]] == list(range(count))
    assert seen[0] == seen[1]
    assert consumers[0].decoded_ahead > 0
    for consumer in consumers:
        with pytest.raises(StopIteration):
            consumer.next_micro_batch(timeout_s=POLL_BOUND_S)
        consumer.close()


def test_close_stops_the_thread_and_a_dropped_consumer_stops_it_too(ring):
    spec, _ = ring
    before = len(_decode_ahead_threads())
    closed = MicroBatchConsumer(spec, 0)
    assert len(_decode_ahead_threads()) == before + 1
    closed.close()
    assert len(_decode_ahead_threads()) == before
    dropped = MicroBatchConsumer(spec, 1)
    assert len(_decode_ahead_threads()) == before + 1
    del dropped
    gc.collect()
    _poll(lambda: len(_decode_ahead_threads()) == before, "the dropped consumer's thread to end")


def test_corrupt_metadata_still_raises_from_the_consumer(ring):
    """The thread drops a decode that fails; the consumer's own decode raises, naming the ring."""
    spec, publisher = ring
    _publish(publisher, 0)
    owner = SlotRing.attach(spec)
    start = spec._meta_offset + 16  # past the slot's (seq, length) header
    owner._buf[start : start + 4] = b"XXXX"  # the record's magic
    consumer = MicroBatchConsumer(spec, 0)  # its thread finds the corrupt record published
    with pytest.raises(RuntimeError, match=spec.name):
        consumer.next_micro_batch(timeout_s=POLL_BOUND_S)
    assert consumer.decoded_ahead == 0
    owner.close()
    consumer.close()
    assert os.path.exists(f"/dev/shm/{spec.name}")
