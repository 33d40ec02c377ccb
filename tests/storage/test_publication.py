"""The slot-ring publication protocol: order, bounded look-ahead, release rules, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from knitkit.storage.delivery.atomic_words import AtomicWords, _libatomic
from knitkit.storage.delivery.consumer import (
    MicroBatchConsumer,
    ReorganizerDiedError,
    ReorganizerError,
)
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import (
    _PUBLISHED_W,
    _RELEASED_W,
    ConsumerDiedError,
    RingClosedError,
    RingSpec,
    SlotRing,
)
from knitkit.types import MicroBatchLayout


@pytest.fixture
def ring():
    """A 2-slot ring for 2 consumers, its owner, and a started publisher."""
    spec = RingSpec.new(num_slots=2, slot_bytes=4096, num_consumers=2)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    yield spec, owner, publisher
    publisher.close()
    owner.close()
    owner.unlink()
    assert not os.path.exists(f"/dev/shm/{spec.name}")


def _publish(publisher: Publisher, value: int) -> int:
    layout = MicroBatchLayout.build({"x": ("int64", (4,))}, extra={"value": value})
    layout.numpy_views(publisher.acquire(layout.nbytes))["x"][:] = value
    return publisher.publish(layout)


def test_order_and_identical_views(ring):
    """Every consumer sees every micro-batch once, in publication order, as the same bytes."""
    spec, _, publisher = ring
    consumers = [MicroBatchConsumer(spec, i) for i in range(2)]

    def produce():
        for value in range(6):
            _publish(publisher, value)
        publisher.finish()

    thread = threading.Thread(target=produce)
    thread.start()
    seen = [[], []]
    for _ in range(6):
        batches = [c.next_micro_batch(timeout_s=10) for c in consumers]
        for i, batch in enumerate(batches):
            seen[i].append((batch.seq, int(batch.fields["x"][0]), batch.layout.extra["value"]))
            assert not batch.fields["x"].flags.writeable
            batch.release()
    thread.join()
    assert seen[0] == seen[1] == [(v, v, v) for v in range(6)]
    for consumer in consumers:
        with pytest.raises(StopIteration):
            consumer.next_micro_batch(timeout_s=1)
        consumer.close()


def test_slot_reused_only_after_every_consumer_released(ring):
    """With 2 slots the producer gets 2 micro-batches ahead and no further until BOTH
    consumers released the oldest; releases may come out of order."""
    spec, owner, publisher = ring
    first, second = MicroBatchConsumer(spec, 0), MicroBatchConsumer(spec, 1)
    _publish(publisher, 0)
    _publish(publisher, 1)
    blocked = threading.Thread(target=_publish, args=(publisher, 2))
    blocked.start()
    a0, a1 = first.next_micro_batch(timeout_s=5), first.next_micro_batch(timeout_s=5)
    b0 = second.next_micro_batch(timeout_s=5)
    a1.release()  # out of order: slot 0 is still held by a0 and b0
    b0.release()
    time.sleep(0.2)
    assert blocked.is_alive() and owner.published == 2
    a0.release()
    blocked.join(timeout=5)
    assert not blocked.is_alive() and owner.published == 3
    assert int(first.next_micro_batch(timeout_s=5).fields["x"][0]) == 2
    first.close()
    second.close()


def test_stop_request_unblocks_producer(ring):
    """A producer waiting on a full ring raises RingClosedError once the owner asks it to stop."""
    _, owner, publisher = ring
    _publish(publisher, 0)
    _publish(publisher, 1)
    threading.Timer(0.2, owner.request_stop).start()
    with pytest.raises(RingClosedError, match="stop"):
        _publish(publisher, 2)


def test_sizes_are_checked(ring):
    """A micro-batch larger than a slot, or a layout larger than the metadata area, is refused
    with the size to configure."""
    spec, _, publisher = ring
    with pytest.raises(ValueError, match="slot_bytes=4096"):
        publisher.acquire(spec.slot_bytes + 1)
    ids = tuple(f"trajectory-{i:06d}" for i in range(5000))
    layout = MicroBatchLayout.build({"x": ("int64", (1,))}, trajectory_ids=ids)
    publisher.acquire(layout.nbytes)
    with pytest.raises(ValueError, match="meta_bytes"):
        publisher.publish(layout)


def test_failure_and_death_reach_consumers(ring):
    """A failed producer's message reaches consumers; a producer whose role lock is free is
    dead, whatever its pid (NOTE [ Ring role locks ])."""
    spec, owner, publisher = ring
    consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=1.0)
    publisher.fail("unit t3/routing vanished")
    with pytest.raises(ReorganizerError, match="t3/routing vanished"):
        consumer.next_micro_batch(timeout_s=5)
    owner.set_state(1)  # pretend it runs again, then its file closes as a death closes it
    owner.beat()
    publisher.ring.close()
    with pytest.raises(ReorganizerDiedError, match="died"):
        consumer.next_micro_batch(timeout_s=5)
    consumer.close()


def test_stale_heartbeat_is_death(ring):
    """A live pid that stops beating for longer than the liveness timeout counts as dead."""
    spec, _, publisher = ring
    publisher._stop_heartbeat()
    consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(ReorganizerDiedError, match="heartbeat"):
        consumer.next_micro_batch(timeout_s=5)
    assert time.monotonic() - start < 2.0
    consumer.close()


def test_attach_errors_name_the_ring():
    """Attaching to a ring that does not exist says which and what to do."""
    spec = RingSpec.new(num_slots=1, slot_bytes=64, num_consumers=1)
    with pytest.raises(FileNotFoundError, match=spec.name):
        MicroBatchConsumer(spec, 0)
    with pytest.raises(ValueError, match="consumer_index"):
        MicroBatchConsumer(spec, 3)


class _RecordingWords(AtomicWords):
    """AtomicWords that log every release store and acquire load, with a probe at each store."""

    def __init__(self, words, log, probe=None):
        super().__init__(words)
        self.log = log
        self.probe = probe

    def load_acquire(self, index: int) -> int:
        value = super().load_acquire(index)
        self.log.append(("acquire", index, value))
        return value

    def loads_acquire(self, first: int, count: int) -> list[int]:
        values = list(super().loads_acquire(first, count))
        self.log.extend(("acquire", first + i, value) for i, value in enumerate(values))
        return values

    def store_release(self, index: int, value: int) -> None:
        if self.probe is not None:
            self.probe(index, value)
        self.log.append(("release", index, value))
        super().store_release(index, value)


def test_publication_ordering_contract(ring):
    """The ordering contract of NOTE [ Publication ordering ]: PUBLISHED = seq + 1 is stored with
    a release store only once the slot's payload and metadata are complete; a consumer reads a
    slot only after an acquire load saw it published, and hands it back with a release store of
    RELEASED after its reads; the producer reuses a slot only after an acquire load of RELEASED."""
    assert _libatomic() is not None or os.uname().machine == "x86_64"
    spec, _, publisher = ring
    log: list[tuple] = []

    def probe(index: int, value: int) -> None:
        if index == _PUBLISHED_W:  # the instant before PUBLISHED becomes visible
            seq = value - 1
            layout = publisher.ring.read_meta(seq)
            data = layout.numpy_views(publisher.ring.slot(seq, layout.nbytes))["x"]
            log.append(("complete-at-publish", seq, int(data[0]), layout.extra["value"]))

    publisher.ring._atomic = _RecordingWords(publisher.ring.words, log, probe)
    consumer = MicroBatchConsumer(spec, 0)
    consumer._ring._atomic = _RecordingWords(consumer._ring.words, log)
    original_read_meta = consumer._ring.read_meta

    def read_meta(seq: int) -> MicroBatchLayout:
        log.append(("consumer-read", seq))
        return original_read_meta(seq)

    consumer._ring.read_meta = read_meta  # type: ignore[method-assign]
    for value in range(spec.num_slots):  # consumer 1 never reads: no slot is reused
        _publish(publisher, 10 + value)
        batch = consumer.next_micro_batch(timeout_s=10)
        assert int(batch.fields["x"][0]) == 10 + value
        batch.release()
    consumer.close()

    assert [e for e in log if e[0] == "complete-at-publish"] == [
        ("complete-at-publish", s, 10 + s, 10 + s) for s in range(spec.num_slots)
    ]
    for seq in range(spec.num_slots):
        read_at = log.index(("consumer-read", seq))
        seen = [e for e in log[:read_at] if e[:2] == ("acquire", _PUBLISHED_W) and e[2] > seq]
        assert seen, f"micro-batch {seq} read before an acquire load saw it published"
        released_at = log.index(("release", _RELEASED_W + 0, seq + 1))
        assert released_at > read_at
    assert any(e[:2] == ("acquire", _RELEASED_W) for e in log)  # the producer's side of reuse


def test_atomic_words_are_shared_between_mappings():
    """Release stores through one mapping are seen by acquire loads through another."""
    spec = RingSpec.new(num_slots=1, slot_bytes=64, num_consumers=1)
    owner = SlotRing.create(spec)
    try:
        other = SlotRing.attach(spec)
        owner.set_published(7)
        other.set_released(0, 5)
        assert (other.published, owner.released(0), owner.min_released()) == (7, 5, 5)
        other.close()
    finally:
        owner.close()
        owner.unlink()


def test_a_consumer_that_leaves_a_live_stream_fails_the_ring_naming_it(ring):
    """A TP rank that leaves through Python (close, an exception out of ``with``, sys.exit: its
    consumer detaches) while the producer still runs: the producer, once it waits for that rank's
    release, fails the ring naming the consumer, and its peer raises ``ReorganizerError`` at once
    instead of waiting for a micro-batch that can never come (issue 30, item 9)."""
    spec, _, publisher = ring
    peer = MicroBatchConsumer(spec, 1, liveness_timeout_s=5.0)
    leaving = MicroBatchConsumer(spec, 0, liveness_timeout_s=5.0)
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            for value in range(6):
                _publish(publisher, value)
        except BaseException as error:
            publisher.fail(str(error))  # as ReorganizerHost writes it for the consumers
            errors.append(error)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    with leaving.next_micro_batch(timeout_s=30):
        pass
    leaving.close()  # leaves at micro-batch 1 while the producer still has 5 to publish
    start = time.monotonic()
    with pytest.raises(ReorganizerError, match=r"consumer 0 \(pid \d+\) .* left at micro-batch 1"):
        for _ in range(6):
            peer.next_micro_batch(timeout_s=60).release()
    assert time.monotonic() - start < 30
    producer.join(30)
    assert len(errors) == 1 and "left at micro-batch 1" in str(errors[0])
    peer.close()


_EXITS_HOLDING = """
import sys
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.slot_ring import RingSpec
consumer = MicroBatchConsumer(RingSpec({name!r}, 2, 4096, 2), 0)
lease = consumer.next_micro_batch(timeout_s=60)
print("holding", lease.seq, flush=True)
sys.exit(0)  # through Python, holding the lease, the consumer never closed
"""


def test_a_consumer_process_exiting_through_python_fails_the_ring_for_its_peer(ring):
    """The exit finalizer of a consumer never closed (sys.exit, an uncaught exception, Ctrl-C)
    marks it as left, as a death would: its TP peer raises ``ReorganizerError`` naming it instead
    of waiting (the finalizer used to zero its pid, which reads as 'not attached yet')."""
    spec, _, publisher = ring
    peer = MicroBatchConsumer(spec, 1, liveness_timeout_s=5.0)
    _publish(publisher, 0)
    child = subprocess.run(
        [sys.executable, "-c", _EXITS_HOLDING.format(name=spec.name)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert child.returncode == 0 and "holding 0" in child.stdout, child
    producer = threading.Thread(
        target=lambda: _publish_until_failed(publisher, range(1, 6)), daemon=True
    )
    producer.start()
    with pytest.raises(ReorganizerError, match=r"consumer 0 \(pid \d+\) .* left at micro-batch 0"):
        for _ in range(6):
            peer.next_micro_batch(timeout_s=60).release()
    producer.join(30)
    peer.close()


def _publish_until_failed(publisher: Publisher, values: range) -> None:
    try:
        for value in values:
            _publish(publisher, value)
    except ConsumerDiedError as error:
        publisher.fail(str(error))  # as ReorganizerHost writes it for the consumers
