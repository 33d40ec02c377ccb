"""The iterator over a ring consumer: it owns every lease it pulls, whatever wraps the consumer;
one prefetch thread; bounded takes; private views; clear errors when the consumer goes away."""

from __future__ import annotations

import resource
import threading
import time
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
from task_switches import voluntary_switches

from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.storage.delivery.consumer import (
    ConsumerClosedError,
    MicroBatchConsumer,
    ReorganizerError,
    Take,
)
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.types import MicroBatchLayout

BOUND_S = 60.0
"""Generous bound for a wait on a loaded machine."""
ROWS = 256


def expected(value: int) -> np.ndarray:
    return np.arange(ROWS, dtype=np.int64) + 1000 * value


class Ring:
    """A slot ring, its owner and a started publisher; ``publish(v)`` packs ``expected(v)``."""

    def __init__(self, num_slots: int, num_consumers: int = 1) -> None:
        self.spec = RingSpec.new(
            num_slots=num_slots, slot_bytes=1 << 16, num_consumers=num_consumers
        )
        self.owner = SlotRing.create(self.spec)
        self.publisher = Publisher(SlotRing.attach(self.spec))
        self.publisher.start()

    def publish(self, value: int) -> None:
        layout = MicroBatchLayout.build({"x": ("int64", (ROWS,))}, extra={"value": value})
        layout.numpy_views(self.publisher.acquire(layout.nbytes))["x"][:] = expected(value)
        self.publisher.publish(layout)

    def produce(self, count: int, *, finish: bool = True) -> threading.Thread:
        def run() -> None:
            for value in range(count):
                self.publish(value)
            if finish:
                self.publisher.finish()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.owner.request_stop()
        self.publisher.close()
        self.owner.close()
        self.owner.unlink()


@pytest.fixture
def make_ring() -> Iterator:
    made: list[Ring] = []

    def make(num_slots: int, num_consumers: int = 1) -> Ring:
        made.append(Ring(num_slots, num_consumers))
        return made[-1]

    yield make
    for ring in made:
        ring.close()


def _hold_and_check(observer: SlotRing, mb, value: int) -> None:
    """Hold ``mb`` long enough for a wrongly released slot to be refilled, then check it."""
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:
        assert observer.released(0) <= mb.index, "a held micro-batch's slot was released"
        time.sleep(0.005)
    assert np.array_equal(mb["x"].numpy(), expected(value)), f"micro-batch {value} was overwritten"


def test_a_generator_wrapped_consumer_never_loses_a_held_slot(make_ring):
    """One iteration contract: the iterator owns each lease it pulls, also through a generator
    that wraps the consumer (no sniffing, no release by the consumer's own iteration). The slot
    the training loop holds is never released under it (a 2-slot ring would refill it at once),
    and every micro-batch is released exactly once in the end."""
    ring = make_ring(num_slots=2)
    ring.produce(12)
    observer = SlotRing.attach(ring.spec)
    consumer = MicroBatchConsumer(ring.spec, 0, liveness_timeout_s=BOUND_S)
    wrapped = (lease for lease in consumer)
    seen = []
    with MicroBatchIterator(
        wrapped, MicroBatchIterator.Config(depth=2, next_timeout_s=BOUND_S), device="cpu"
    ) as it:
        for mb in it:
            _hold_and_check(observer, mb, mb.index)
            seen.append(mb.layout.extra["value"])
    assert seen == list(range(12))
    assert observer.released(0) == 12
    consumer.close()
    observer.close()


def test_an_in_place_write_stays_with_the_writing_rank(make_ring):
    """Zero-copy CPU tensors are private copy-on-write views: a rank's in-place write into a
    yielded tensor changes its own view only; its TP peer reads the published bytes, and the
    writer reads every later occupant of the same slots correctly (NOTE [ Zero-copy hand-off ])."""
    ring = make_ring(num_slots=2, num_consumers=2)
    count = 8
    ring.produce(count)
    peer_may_read = [threading.Event() for _ in range(count)]
    peer_saw: list[np.ndarray] = []

    def peer() -> None:
        with MicroBatchConsumer(ring.spec, 1, liveness_timeout_s=BOUND_S) as consumer:
            for value in range(count):
                assert peer_may_read[value].wait(BOUND_S)
                lease = consumer.next_micro_batch(timeout_s=BOUND_S)
                peer_saw.append(lease.fields["x"].copy())
                lease.release()

    peer_thread = threading.Thread(target=peer)
    peer_thread.start()
    consumer = MicroBatchConsumer(ring.spec, 0, liveness_timeout_s=BOUND_S)
    with MicroBatchIterator(
        consumer, MicroBatchIterator.Config(depth=2, next_timeout_s=BOUND_S), device="cpu"
    ) as it:
        for mb in it:
            assert mb.flat.untyped_storage().nbytes() <= ring.spec.slot_bytes  # no staging copy
            assert np.array_equal(mb["x"].numpy(), expected(mb.index))
            mb["x"].mul_(0).sub_(1)  # e.g. a user masking a field in place
            assert (mb["x"] == -1).all()  # the writer sees its write
            peer_may_read[mb.index].set()
        assert it.stats.count == count and it.pool.allocations == 0
    peer_thread.join(BOUND_S)
    assert len(peer_saw) == count
    for value, x in enumerate(peer_saw):
        assert np.array_equal(x, expected(value)), f"the peer saw the writer's change in {value}"


def test_a_bounded_take_never_pulls_ahead_and_leaves_the_consumer_open(make_ring):
    """A per-(mini-batch, pass) iterator over ``consumer.take(n)``: exactly n micro-batches even
    with a deeper prefetch and more published (the next pass's may not be packable yet: the
    consumer is never asked for n + 1); closing the iterator leaves the consumer open for the
    next take, which continues in order; a take the producer cannot fill raises."""
    ring = make_ring(num_slots=8)
    ring.produce(5).join(BOUND_S)
    consumer = MicroBatchConsumer(ring.spec, 0, liveness_timeout_s=BOUND_S)
    config = MicroBatchIterator.Config(depth=4, next_timeout_s=BOUND_S)
    with MicroBatchIterator(consumer.take(3), config, device="cpu") as it:
        first = [mb.layout.extra["value"] for mb in it]
        assert consumer.metrics()["knitkit/delivery/handed_out"] == 3
    assert first == [0, 1, 2]
    with MicroBatchIterator(consumer.take(2), config, device="cpu") as it:
        second = [(mb.layout.extra["value"], int(mb["x"][0])) for mb in it]
    assert second == [(3, 3000), (4, 4000)]
    assert ring.owner.released(0) == 5
    with (
        MicroBatchIterator(consumer.take(1), config, device="cpu") as it,
        pytest.raises(RuntimeError, match="finished after 0 of the 1"),
    ):
        next(it)
    consumer.close()


def test_closing_an_iterator_whose_take_waits_returns_at_once(make_ring):
    """The prefetch thread waiting inside a take for a micro-batch not yet published is
    interrupted by close(): close returns without the join timeout or a warning, and the
    consumer serves the next take once the micro-batch comes."""
    ring = make_ring(num_slots=2)
    consumer = MicroBatchConsumer(ring.spec, 0, liveness_timeout_s=BOUND_S)
    config = MicroBatchIterator.Config(depth=2, join_timeout_s=BOUND_S, next_timeout_s=BOUND_S)
    it = MicroBatchIterator(consumer.take(1), config, device="cpu")
    time.sleep(0.05)  # the thread is now (most likely) blocked in the consumer's wait
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        it.close()
    assert time.monotonic() - start < BOUND_S / 3
    ring.publish(0)
    with MicroBatchIterator(consumer.take(1), config, device="cpu") as again:
        assert [int(mb["x"][0]) for mb in again] == [0]
    consumer.close()


def test_a_consumer_closed_under_the_iterator_fails_its_next_at_once(make_ring):
    """Closing the consumer while the iterator's thread waits in it: the loop's next next()
    raises ConsumerClosedError naming the consumer at once, not a 'never started' error after
    the start-up timeout."""
    ring = make_ring(num_slots=2)
    ring.produce(1, finish=False)
    consumer = MicroBatchConsumer(ring.spec, 0, startup_timeout_s=120.0)
    with MicroBatchIterator(
        consumer, MicroBatchIterator.Config(depth=2, next_timeout_s=BOUND_S), device="cpu"
    ) as it:
        assert next(it).index == 0
        start = time.monotonic()
        consumer.close()
        with pytest.raises(ConsumerClosedError, match=f"consumer 0 of ring '{ring.spec.name}'"):
            next(it)
        assert time.monotonic() - start < BOUND_S / 3


def test_next_from_a_second_thread_names_the_owner_and_claim_hands_over(counting_source):
    """The thread that calls next() first owns the iterator; another thread's next() raises
    naming both threads and claim(); after claim() the new thread consumes, in order."""
    it = MicroBatchIterator(counting_source(4), device="cpu")
    got: list[int] = []
    worker = threading.Thread(target=lambda: got.append(next(it).index), name="loop-a")
    worker.start()
    worker.join(BOUND_S)
    with pytest.raises(RuntimeError, match=r"'loop-a'.*claim\(\)"):
        next(it)
    it.claim()
    got += [mb.index for mb in it]
    assert got == [0, 1, 2, 3]


def test_metrics_are_flat_namespaced_floats(make_ring):
    """metrics() of the iterator and the consumer: flat {knitkit/delivery/...: float}, counting
    what was delivered."""
    ring = make_ring(num_slots=4)
    ring.produce(3)
    consumer = MicroBatchConsumer(ring.spec, 0, liveness_timeout_s=BOUND_S)
    with MicroBatchIterator(consumer.take(3), device="cpu") as it:
        nbytes = sum(mb.layout.nbytes for mb in it)
        figures = it.metrics()
    assert figures["knitkit/delivery/micro_batches"] == 3.0
    assert figures["knitkit/delivery/bytes"] == float(nbytes)
    assert figures["knitkit/delivery/exposed_wait_s"] >= 0.0
    both = {**figures, **consumer.metrics()}
    assert all(k.startswith("knitkit/delivery/") and type(v) is float for k, v in both.items())
    assert both["knitkit/delivery/handed_out"] == 3.0
    assert both["knitkit/delivery/handed_out_bytes"] == float(nbytes)
    consumer.close()


def test_two_tp_ranks_read_every_micro_batch_once_bit_identical_while_the_ring_wraps(make_ring):
    """The one-copy path (issue 31.1): two TP ranks iterate the same 2-slot ring concurrently
    while the producer wraps around it 8 times; each rank gets every micro-batch exactly once, in
    order, bit-identical to what was published, over the ring itself (no staging copy), even
    though each rank writes into every tensor it holds."""
    ring = make_ring(num_slots=2, num_consumers=2)
    count = 16
    producer = ring.produce(count)
    seen: dict[int, list[int]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            consumer = MicroBatchConsumer(ring.spec, index, liveness_timeout_s=BOUND_S)
            config = MicroBatchIterator.Config(depth=1, next_timeout_s=BOUND_S)
            with consumer, MicroBatchIterator(consumer, config, device="cpu") as it:
                for mb in it:
                    value = mb.layout.extra["value"]
                    assert mb["x"].numpy().tobytes() == expected(value).tobytes(), (index, value)
                    mb["x"][index::2] = -1  # each rank its own in-place write
                    seen[index].append(value)
                assert it.pool.allocations == 0
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND_S)
    producer.join(BOUND_S)
    assert not errors, errors
    assert seen == {0: list(range(count)), 1: list(range(count))}


def test_a_lease_released_late_never_sees_its_slot_overwritten(make_ring):
    """TP rank 1 holds micro-batch 0 while rank 0 has taken and released micro-batches 0 and 1
    of a 2-slot ring: the producer cannot publish micro-batch 2 into slot 0 (rank 0 waits in
    vain), rank 1's lease still reads micro-batch 0 exactly, and once it is released late the
    producer goes on."""
    ring = make_ring(num_slots=2, num_consumers=2)
    producer = ring.produce(3)
    late = MicroBatchConsumer(ring.spec, 1, liveness_timeout_s=BOUND_S)
    held = late.next_micro_batch(timeout_s=BOUND_S)
    with MicroBatchConsumer(ring.spec, 0, liveness_timeout_s=BOUND_S) as ahead:
        for value in (0, 1):
            with ahead.next_micro_batch(timeout_s=BOUND_S) as lease:
                assert np.array_equal(lease.fields["x"], expected(value))
        with pytest.raises(TimeoutError, match="no micro-batch 2"):
            ahead.next_micro_batch(timeout_s=0.5)  # slot 0 is still leased by rank 1
        assert ring.owner.published == 2
        assert np.array_equal(held.fields["x"], expected(0))
        assert held.private is not None
        assert np.array_equal(np.frombuffer(held.private(), np.int64)[:ROWS], expected(0))
        held.release()
        with ahead.next_micro_batch(timeout_s=BOUND_S) as lease:
            assert np.array_equal(lease.fields["x"], expected(2))
    producer.join(BOUND_S)
    late.close()


def _prefetch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("knitkit-microbatch-")]


def _others_sleeps() -> dict[str, int]:
    """Voluntary context switches so far of every thread of this process but the caller's."""
    sleeps = voluntary_switches("/proc/self/task/*/status")
    del sleeps[f"/proc/self/task/{threading.get_native_id()}/status"]
    return sleeps


def _sleeps_since(before: tuple[dict[str, int], int]) -> int:
    """Voluntary context switches since ``before`` of this thread and of every thread started
    since, exited ones too: the process's total less what the threads that were already there
    did, read so that their share is never under-counted (the session's Ray driver threads and
    other tests' leftovers wake on their own: counted in, they made this test flaky)."""
    others, total = before
    total = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - total
    now = _others_sleeps()
    return total - sum(now.get(task, count) - count for task, count in others.items())


def test_a_cpu_take_is_handed_out_inline_with_no_thread_and_no_sleep(make_ring):
    """Over a consumer's take on CPU, next() takes each published lease on the loop's thread
    (NOTE [ Inline hand-out ]): no prefetch thread starts, and 32 micro-batches published ahead
    cost no sleep of the loop's thread or of any thread started meanwhile (on b870bfe: a prefetch
    thread, 33-55 voluntary context switches, one or more per micro-batch); every lease is
    released once, in order."""
    ring = make_ring(num_slots=40)
    ring.produce(32).join(BOUND_S)
    consumer = MicroBatchConsumer(ring.spec, 0, liveness_timeout_s=BOUND_S)
    threads = _prefetch_threads()
    config = MicroBatchIterator.Config(depth=2, next_timeout_s=BOUND_S)
    before = (_others_sleeps(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw)
    with MicroBatchIterator(consumer.take(32), config, device="cpu") as it:
        assert _prefetch_threads() == threads
        seen = [(mb.layout.extra["value"], int(mb["x"][1])) for mb in it]
    sleeps = _sleeps_since(before)
    assert seen == [(v, 1000 * v + 1) for v in range(32)]
    assert sleeps <= 2, sleeps
    assert ring.owner.released(0) == 32
    consumer.close()


def test_an_inline_hand_out_keeps_the_timeout_close_and_error_contracts(make_ring):
    """Inline, next() still times out after next_timeout_s (naming it) and stays usable; a
    close() from another thread ends a waiting next() at once with StopIteration; a producer's
    failure is raised once, then StopIteration."""
    ring = make_ring(num_slots=2)
    consumer = MicroBatchConsumer(ring.spec, 0, liveness_timeout_s=BOUND_S)
    config = MicroBatchIterator.Config(depth=1, next_timeout_s=0.5)
    with MicroBatchIterator(consumer.take(3), config, device="cpu") as it:
        with pytest.raises(TimeoutError, match=r"next_timeout_s=0\.5"):
            next(it)
        ring.publish(0)
        assert next(it).layout.extra["value"] == 0

        def close_once_waiting() -> None:
            deadline = time.monotonic() + BOUND_S
            while not ring.owner.consumer_waits(0) and time.monotonic() < deadline:
                time.sleep(0.001)
            it.close()

        closer = threading.Thread(target=close_once_waiting)
        closer.start()
        start = time.monotonic()
        it.config.next_timeout_s = BOUND_S
        with pytest.raises(StopIteration):
            next(it)
        assert time.monotonic() - start < BOUND_S / 3
        closer.join(BOUND_S)
    assert ring.owner.released(0) == 1
    with MicroBatchIterator(consumer.take(1), config, device="cpu") as it:
        ring.publisher.fail("disk on fire")
        with pytest.raises(ReorganizerError, match="disk on fire"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)
    consumer.close()


def test_a_take_that_checks_its_leases_keeps_the_prefetch_thread(make_ring):
    """A ``Take`` subclass that overrides ``__next__`` (a job's checked take) has no inline
    hand-out: the prefetch thread pulls it through its own ``__next__``, checks included; so
    does ``hand_out_inline=False`` for a consumer's take."""
    ring = make_ring(num_slots=4)
    ring.produce(4).join(BOUND_S)
    consumer = MicroBatchConsumer(ring.spec, 0, liveness_timeout_s=BOUND_S)
    checked: list[int] = []

    class Checked(Take):
        def __next__(self):
            lease = super().__next__()
            checked.append(lease.layout.extra["value"])
            return lease

    config = MicroBatchIterator.Config(depth=1, next_timeout_s=BOUND_S)
    with MicroBatchIterator(Checked(consumer, 2), config, device="cpu") as it:
        assert [mb.layout.extra["value"] for mb in it] == [0, 1] == checked
    threaded = MicroBatchIterator.Config(depth=1, next_timeout_s=BOUND_S, hand_out_inline=False)
    threads = _prefetch_threads()
    with MicroBatchIterator(consumer.take(2), threaded, device="cpu") as it:
        assert len(_prefetch_threads()) == len(threads) + 1
        assert [mb.layout.extra["value"] for mb in it] == [2, 3]
    consumer.close()
