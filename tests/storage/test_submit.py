"""``ReorganizerProcess.submit`` writes an assignment into an empty pipe itself (no sender thread,
no thread switch before the child can read it) and hands it to the sender thread otherwise,
never blocking and keeping the order (NOTE [ Assignments written in place ])."""

from __future__ import annotations

import threading

import numpy as np
from delivery_payloads import fill_backend, make_metas, plan_for
from ring_parts import until_producer_waits

from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingSpec
from knitkit.storage.planning.plan import ConsumerPlan, Topology

WAIT_S = 120.0
"""Bound of every wait on another process: generous, for a loaded machine."""


def _senders(spec: RingSpec) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"knitkit-reorganizer-submit-{spec.name}"]


def _group(backend: SharedMemoryBackend) -> ConsumerPlan:
    metas = make_metas(np.full(4, 120).tolist())
    fill_backend(backend, metas)
    group = plan_for(metas, Topology(dp=1, cp=1, tp=1), 240, "mb").consumer(0, 0)
    assert len(group.micro_batches) >= 2
    return group


def _take_all(consumer: MicroBatchConsumer, count: int) -> list[str]:
    """The mini-batch id of each of the next ``count`` micro-batches (each released)."""
    ids = []
    for _ in range(count):
        lease = consumer.next_micro_batch(timeout_s=WAIT_S)
        ids.append(str(lease.layout.extra["minibatch_id"]))
        lease.release()
    return ids


def test_an_idle_reorganizer_gets_its_assignments_without_a_sender_thread() -> None:
    """Assignments submitted to a reorganizer that has read the previous ones (its pipe empty)
    are written by ``submit`` itself: no sender thread ever starts, and every micro-batch
    arrives, in order."""
    backend = SharedMemoryBackend(slab_bytes=2 << 20)
    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 18, num_consumers=1)
    try:
        group = _group(backend)
        count = len(group.micro_batches)
        with (
            ReorganizerProcess(backend, spec, liveness_timeout_s=30.0) as reorganizer,
            MicroBatchConsumer(spec, 0, liveness_timeout_s=30.0) as consumer,
        ):
            for step in range(3):
                reorganizer.submit(f"mb{step}", group)
                assert _take_all(consumer, count) == [f"mb{step}"] * count
                assert not _senders(spec)
    finally:
        backend.close()


def test_assignments_behind_a_busy_reorganizer_go_through_the_sender_in_order() -> None:
    """While the child is blocked on a full ring (its one slot held), more assignments than the
    pipe holds are submitted: ``submit`` returns for each (the sender thread writes them as the
    child reads), and after the release every micro-batch arrives in submission order."""
    backend = SharedMemoryBackend(slab_bytes=2 << 20)
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 18, num_consumers=1)
    try:
        group = _group(backend)
        count = len(group.micro_batches)
        submits = 200  # ~1 KiB each: three times a 64 KiB pipe
        with (
            ReorganizerProcess(backend, spec, liveness_timeout_s=30.0) as reorganizer,
            MicroBatchConsumer(spec, 0, liveness_timeout_s=30.0) as consumer,
        ):
            reorganizer.submit("mb0", group)
            held = consumer.next_micro_batch(timeout_s=WAIT_S)  # the ring's only slot
            until_producer_waits(reorganizer.ring, WAIT_S)  # blocked on the full ring
            submitter = threading.Thread(
                target=lambda: [reorganizer.submit(f"mb{i}", group) for i in range(1, submits)]
            )
            submitter.start()
            submitter.join(WAIT_S)
            assert not submitter.is_alive(), "submit blocked on a busy reorganizer"
            assert _senders(spec), "a full pipe's assignments went through no sender thread"
            assert reorganizer.ring.published == 1  # the child is still held
            held.release()
            ids = ["mb0", *_take_all(consumer, submits * count - 1)]
        assert ids == [f"mb{i}" for i in range(submits) for _ in range(count)]
    finally:
        backend.close()
