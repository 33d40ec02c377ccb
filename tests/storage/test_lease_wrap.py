"""The lease contract across a ring wrap: a slot is never refilled while a TP rank holds it,
however far its peer ran ahead, and a lease released late reads exactly what was published."""

from __future__ import annotations

import hashlib
import sys
import threading
import time

import numpy as np
from delivery_payloads import fill_backend, make_metas, plan_for, real_tokens

from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer import Reorganizer
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.storage.planning.plan import Topology
from knitkit.types import PackedMicroBatch

WAIT_S = 30.0
"""Bound of every wait here; each ends as soon as its event happens."""


def _digest(lease: PackedMicroBatch) -> tuple[str, str]:
    """The lease's bytes as its holder reads them: the shared view and its private view."""
    assert lease.private is not None
    return (
        hashlib.sha256(lease.buffer).hexdigest(),
        hashlib.sha256(lease.private()).hexdigest(),
    )


def _wait_until_blocked_on_a_release(producer: threading.Thread, ring: SlotRing) -> None:
    """Return once the producer thread sleeps in its wait for a consumer's release (or has
    published a third micro-batch, or ended: what a producer that refills a held slot does)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and producer.is_alive() and ring.published <= 2:
        frame = sys._current_frames().get(producer.ident or -1)
        while frame is not None:
            if frame.f_code.co_name == "wait_released":
                return
            frame = frame.f_back
        time.sleep(0.001)


def test_a_lease_released_late_never_sees_its_slot_overwritten() -> None:
    """Both TP ranks of a 2-slot ring lease micro-batch 0 (slot 0). Rank 1 releases it and
    moves through slot 1; rank 0 keeps its lease and releases its newer one first (out of
    order). The reorganizer, wanting slot 0 for micro-batch 2, waits for rank 0 (seen asleep in
    its wait for that release, with 2 published) and the held lease still reads what was
    published, through its shared and its private view. Released late, it lets the reorganizer
    wrap around the ring again and again: every micro-batch reaches both ranks bit-identical and
    every token arrives exactly once."""
    metas = make_metas([37, 5, 91, 12, 60, 23, 44, 8, 70, 19])
    backend = SharedMemoryBackend(slab_bytes=1 << 20)
    total = fill_backend(backend, metas)
    group = plan_for(metas, Topology(dp=1, tp=2), 48, "mb").consumer(0, 0)
    count = len(group.micro_batches)
    assert count >= 6  # three times round the ring
    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 16, num_consumers=2)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    ranks = [MicroBatchConsumer(spec, r, liveness_timeout_s=WAIT_S) for r in range(2)]
    reorganizer = Reorganizer(backend, publisher)

    def produce() -> None:
        reorganizer.deliver("mb", group)
        publisher.finish()

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        held = ranks[0].next_micro_batch(timeout_s=WAIT_S)
        published = _digest(held)
        tokens = [real_tokens(held.fields)]
        with ranks[1].next_micro_batch(timeout_s=WAIT_S) as peer:
            assert peer.seq == held.seq == 0 and _digest(peer) == published
        with ranks[1].next_micro_batch(timeout_s=WAIT_S) as ahead:
            digests = [published, _digest(ahead)]
        with ranks[0].next_micro_batch(timeout_s=WAIT_S) as newer:  # released before `held`
            assert newer.seq == 1 and _digest(newer) == digests[1]
            tokens.append(real_tokens(newer.fields))
        _wait_until_blocked_on_a_release(producer, owner)
        assert owner.published == 2, "slot 0 was refilled while rank 0 held its lease"
        assert _digest(held) == published
        held.release()  # late: the reorganizer refills slot 0 only now
        for seq in range(2, count):
            leases = [rank.next_micro_batch(timeout_s=WAIT_S) for rank in ranks]
            assert [lease.seq for lease in leases] == [seq, seq]
            assert _digest(leases[0]) == _digest(leases[1])
            tokens.append(real_tokens(leases[0].fields))
            for lease in leases:
                lease.release()
        producer.join(WAIT_S)
        assert not producer.is_alive()
        for rank in ranks:
            assert list(rank) == []
    finally:
        owner.request_stop()
        producer.join(WAIT_S)
        for rank in ranks:
            rank.close()
        publisher.close()
        owner.close()
        owner.unlink()
        backend.close()
    got = np.sort(np.concatenate(tokens))
    want = np.sort(
        np.concatenate([(i << 20) + np.arange(m.num_tokens) for i, m in enumerate(metas)])
    )
    assert got.size == total and np.array_equal(got, want)
