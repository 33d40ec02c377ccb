"""The consumer's hand-outs are leases: released exactly once, one attachment per index, a close
that ends a wait at once, a truncated ring that fails cleanly, waits that block in the kernel."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

from knitkit.storage.delivery.atomic_words import AtomicWords, futex_available
from knitkit.storage.delivery.consumer import ConsumerClosedError, MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.types import MicroBatchLayout

BOUND_S = 30.0
"""Generous bound for anything that should happen at once, on a loaded machine."""


@pytest.fixture
def ring() -> Iterator[tuple[RingSpec, SlotRing, Publisher]]:
    """A 2-slot ring for 2 consumers, its owner, and a started publisher."""
    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 16, num_consumers=2)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    yield spec, owner, publisher
    publisher.close()
    owner.close()
    owner.unlink()


def publish(publisher: Publisher, value: int) -> int:
    layout = MicroBatchLayout.build({"x": ("int64", (4,))}, extra={"value": value})
    layout.numpy_views(publisher.acquire(layout.nbytes))["x"][:] = value
    return publisher.publish(layout)


def produce(publisher: Publisher, count: int) -> threading.Thread:
    def run() -> None:
        for value in range(count):
            publish(publisher, value)
        publisher.finish()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_plain_consumer_loop_releases_each_lease_once(ring):
    """One contract: every hand-out is a lease its holder releases (here with ``with``); the loop
    over a 2-slot ring runs to the producer's end, each micro-batch once, the release count
    follows the leases, and a second release does nothing."""
    spec, owner, publisher = ring
    producer = produce(publisher, 7)
    seen = []
    with MicroBatchConsumer(spec, 0) as consumer, MicroBatchConsumer(spec, 1) as peer:
        for lease in consumer:
            with lease, peer.next_micro_batch(timeout_s=BOUND_S) as twin:
                seen.append((lease.seq, int(lease.fields["x"][0]), int(twin.fields["x"][0])))
                assert not lease.fields["x"].flags.writeable
            assert lease.released and owner.released(0) == lease.seq + 1
            lease.release()  # exactly once: the count does not move again
            assert owner.released(0) == lease.seq + 1
    producer.join(BOUND_S)
    assert seen == [(v, v, v) for v in range(7)]


def test_a_dropped_lease_is_released_once_nothing_views_its_bytes(ring):
    """Backstop of the contract: a lease dropped unreleased is released when the last array over
    its slot goes, never earlier (the slot must not be refilled under a live view)."""
    spec, owner, publisher = ring
    publish(publisher, 5)
    consumer = MicroBatchConsumer(spec, 0)
    lease = consumer.next_micro_batch(timeout_s=BOUND_S)
    x = lease.fields["x"]
    del lease
    gc.collect()
    assert owner.released(0) == 0 and x.tolist() == [5] * 4
    del x
    gc.collect()
    assert owner.released(0) == 1
    consumer.close()


def test_one_consumer_index_is_attached_once_per_process(ring):
    """A second handle on the same index in the same process is refused (both would move one
    release count: micro-batches handed out twice, held ones torn); after close it may attach."""
    spec = ring[0]
    first = MicroBatchConsumer(spec, 0)
    with pytest.raises(ValueError, match=rf"consumer_index=0 of ring '{spec.name}'.*this process"):
        MicroBatchConsumer(spec, 0)
    other = MicroBatchConsumer(spec, 1)  # another index is fine
    first.close()
    again = MicroBatchConsumer(spec, 0)
    again.close()
    other.close()


def test_close_ends_a_wait_in_another_thread_at_once(ring):
    """A consumer closed while another thread waits in next_micro_batch() makes that wait raise
    ConsumerClosedError naming the consumer at once, not after the start-up timeout as a
    reorganizer that 'never started'."""
    spec, _, _ = ring
    consumer = MicroBatchConsumer(spec, 0, startup_timeout_s=120.0, wait_timeout_s=600.0)
    errors: list[BaseException] = []
    waiting = threading.Thread(
        target=lambda: _catch(consumer.next_micro_batch, errors), daemon=True
    )
    waiting.start()
    time.sleep(0.1)  # most likely waiting now; closed before it waits raises the same
    start = time.monotonic()
    consumer.close()
    waiting.join(BOUND_S)
    assert time.monotonic() - start < BOUND_S / 3
    assert len(errors) == 1 and isinstance(errors[0], ConsumerClosedError), errors
    assert spec.name in str(errors[0]) and "closed" in str(errors[0])
    with pytest.raises(ConsumerClosedError, match=spec.name):
        consumer.next_micro_batch(timeout_s=1)


def _catch(call, errors: list[BaseException]) -> None:
    try:
        call()
    except BaseException as error:
        errors.append(error)


def test_a_futex_wait_returns_when_woken_not_at_its_timeout():
    """Waits block in the kernel and end at the store's wake (NOTE [ Futex waits ]): a waiter with
    a long timeout returns soon after another thread stores and wakes; a stale expected value
    returns at once."""
    if not futex_available():
        pytest.skip("futex waits are Linux-only; this platform uses the polled fallback")
    words = AtomicWords(np.zeros(4, np.int64))
    words.store_release(1, 2**32 + 7)  # the low half is waited on: crossing 2**32 must work
    returned = threading.Event()

    def wait() -> None:
        words.wait(1, 2**32 + 7, timeout_s=BOUND_S * 4)
        returned.set()

    waiter = threading.Thread(target=wait)
    start = time.monotonic()
    waiter.start()
    time.sleep(0.05)  # let it block (if it has not yet, the store below makes it return at once)
    words.store_release(1, 2**32 + 8)
    words.wake(1)
    assert returned.wait(BOUND_S)
    assert time.monotonic() - start < BOUND_S
    start = time.monotonic()
    words.wait(1, 3, timeout_s=BOUND_S * 4)  # the word does not hold 3: no sleep
    assert time.monotonic() - start < BOUND_S
    waiter.join()


_TRUNCATE = textwrap.dedent(
    """
    import os
    from knitkit.storage.delivery.consumer import MicroBatchConsumer
    from knitkit.storage.delivery.publication import Publisher
    from knitkit.storage.delivery.slot_ring import RingSpec, RingTruncatedError, SlotRing
    from knitkit.types import MicroBatchLayout

    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 16, num_consumers=2)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    layout = MicroBatchLayout.build({"x": ("int64", (4,))})
    publisher.acquire(layout.nbytes)
    publisher.publish(layout)
    consumer = MicroBatchConsumer(spec, 0)
    os.truncate(f"/dev/shm/{spec.name}", 4096)  # another process of this user shrinks it
    try:
        consumer.next_micro_batch(timeout_s=30)
    except RingTruncatedError as error:
        assert spec.name in str(error), error
        print("refused:", error)
    try:
        MicroBatchConsumer(spec, 1)
    except RingTruncatedError:
        print("attach refused")
    owner.unlink()
    os._exit(0)  # the mappings reach past the file's end: leave without touching them
    """
)


def test_a_ring_truncated_under_its_consumer_fails_cleanly_naming_it():
    """Truncating a ring's /dev/shm file under an attached consumer gives RingTruncatedError
    naming the ring, not SIGBUS (run in a child: the old code killed its process)."""
    done = subprocess.run(
        [sys.executable, "-c", _TRUNCATE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "refused:" in done.stdout and "attach refused" in done.stdout


def test_a_forked_child_never_releases_its_parents_leases(ring):
    """A forked child (a DataLoader worker) that releases or drops its copy of a lease hands
    nothing back: only the attaching process moves its release count."""
    spec, owner, publisher = ring
    publish(publisher, 1)
    consumer = MicroBatchConsumer(spec, 0)
    lease = consumer.next_micro_batch(timeout_s=BOUND_S)
    child = os.fork()
    if child == 0:  # the child: release, drop, close, then leave without cleanup
        lease.release()
        del lease
        consumer.close()
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert status == 0
    assert owner.released(0) == 0 and owner.consumer_pid(0) == os.getpid()
    lease.release()
    assert owner.released(0) == 1
    consumer.close()


def test_a_write_through_torch_from_numpy_never_reaches_the_peers(ring):
    """A lease's numpy views are read-only, but ``torch.from_numpy`` only warns and writes: the
    write lands in this consumer's copy-on-write view, never in the shared slot its TP peer
    reads, and the slot's next occupant is read from the shared pages again (issue 30, item 15)."""
    torch = pytest.importorskip("torch")
    spec, _, publisher = ring
    publish(publisher, 3)
    consumer = MicroBatchConsumer(spec, 0)
    with consumer.next_micro_batch(timeout_s=BOUND_S) as lease, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The given NumPy array is not writable"
        torch.from_numpy(lease.fields["x"])[0] = 99
        assert lease.fields["x"].tolist() == [99, 3, 3, 3]  # the write stays with this rank
    with MicroBatchConsumer(spec, 1) as peer:
        with peer.next_micro_batch(timeout_s=BOUND_S) as twin:
            assert twin.fields["x"].tolist() == [3] * 4
        publish(publisher, 4)
        publish(publisher, 5)  # into the slot written through torch above
        for value in (4, 5):
            with consumer.next_micro_batch(timeout_s=BOUND_S) as mine:
                assert mine.fields["x"].tolist() == [value] * 4
    consumer.close()


_FIRST_HAND_OUTS = textwrap.dedent(
    """
    import resource
    from knitkit.storage.delivery.consumer import MicroBatchConsumer
    from knitkit.storage.delivery.publication import Publisher
    from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
    from knitkit.types import MicroBatchLayout

    slot_bytes = 4 << 20
    spec = RingSpec.new(num_slots=3, slot_bytes=slot_bytes, num_consumers=1)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=30)
    layout = MicroBatchLayout.build({"x": ("uint8", (slot_bytes,))})
    for _ in range(spec.num_slots):  # every slot published before the hand-outs
        publisher.acquire(layout.nbytes)[:: 1 << 12] = b"\\1" * (slot_bytes >> 12)
        publisher.publish(layout)
    leases = []
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(spec.num_slots):  # each slot's first lease
        leases.append(consumer.next_micro_batch(timeout_s=30))
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert all(int(lease.buffer[-1]) == 0 for lease in leases)  # read through the mapping
    for lease in leases:
        lease.release()
    consumer.close()
    owner.request_stop()
    publisher.close()
    owner.close()
    owner.unlink()
    print("faults", faults)
    """
)


def test_a_consumer_maps_every_slot_at_attach_so_first_hand_outs_take_no_page_fault():
    """The pages of every slot are mapped when the consumer attaches (NOTE [ Slots mapped at
    attach ] in consumer.py): the first lease of each slot takes no page fault in the rank's
    step. The old code populated each slot at its first lease: a fault per 16 pages read (the
    kernel's fault-around), 3 x 64 here (213 counted); the bound is one slot's. In a fresh
    interpreter: in pytest's process, whose heap earlier tests' forks left copy-on-write, any
    allocation may fault (up to 69 seen in a whole-suite run)."""
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_HAND_OUTS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    faults = int(done.stdout.split()[-1])
    bound = (4 << 20) // (16 << 12)
    assert faults < bound, f"{faults} page faults in the first hand-out of each slot"
