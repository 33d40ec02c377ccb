"""Reorganizer delivery: exactly-once tokens, bit-identical TP copies, bounded look-ahead."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
from delivery_payloads import fill_backend, make_metas, plan_for, real_tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from ring_parts import published_ring

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.backends.disk import SafetensorsBackend
from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer import Reorganizer
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.storage.planning.plan import EncoderRankPlan, Topology
from knitkit.types import UnitKey


def _digest(buffer: memoryview) -> str:
    return hashlib.sha256(buffer).hexdigest()


@settings(max_examples=25, deadline=None)
@given(
    dp=st.integers(1, 3),
    cp=st.integers(1, 3),
    tp=st.integers(1, 3),
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=14),
    budget=st.sampled_from([None, 64, 200]),
    num_slots=st.integers(1, 3),
)
def test_exactly_once_in_process(dp, cp, tp, lengths, budget, num_slots):
    """Every token reaches exactly one (DP, CP) consumer once; TP consumers see identical bytes.

    The reorganizer loop runs in a thread here (many topologies, cheap); the same loop runs in
    spawned processes in ``test_exactly_once_through_processes``.
    """
    if len(lengths) < dp:
        lengths = lengths * dp
    metas = make_metas(lengths)
    backend = MemoryBackend()
    total = fill_backend(backend, metas)
    plans = [plan_for(metas, Topology(dp, cp, tp), budget, f"mb{i}") for i in range(2)]
    seen: list[np.ndarray] = []
    for group in plans[0].consumers:
        spec = RingSpec.new(num_slots=num_slots, slot_bytes=1 << 18, num_consumers=tp)
        owner = SlotRing.create(spec)
        publisher = Publisher(SlotRing.attach(spec))
        publisher.start()
        consumers = [MicroBatchConsumer(spec, r) for r in range(tp)]
        reorganizer = Reorganizer(backend, publisher)

        thread = threading.Thread(target=_produce, args=(reorganizer, plans, group))
        thread.start()
        try:
            for _ in range(2 * len(group.micro_batches)):
                batches = [c.next_micro_batch(timeout_s=30) for c in consumers]
                assert len({_digest(b.buffer) for b in batches}) == 1
                tokens = real_tokens(batches[0].fields)
                if batches[0].layout.extra["minibatch_id"] == "mb0":
                    seen.append(tokens)  # mb1 repeats mb0's plan; count its tokens once
                for b in batches:
                    b.release()
            for c in consumers:
                assert list(c) == []
        finally:
            owner.request_stop()
            thread.join()
            for c in consumers:
                c.close()
            publisher.close()
            owner.close()
            owner.unlink()
    assert backend.bytes_read > 0
    assert np.array_equal(np.sort(np.concatenate(seen)), _all_tokens(metas))
    assert sum(len(s) for s in seen) == total


def _produce(reorganizer: Reorganizer, plans, group) -> None:
    for plan in plans:
        reorganizer.deliver(plan.minibatch_id, plan.consumer(group.dp_rank, group.cp_rank))
    reorganizer.publisher.finish()


def _all_tokens(metas) -> np.ndarray:
    return np.sort(
        np.concatenate([(i << 20) + np.arange(m.num_tokens) for i, m in enumerate(metas)])
    ).astype(np.int64)


def _consume(spec: RingSpec, index: int, results: mp.Queue) -> None:
    """A TP rank in its own process: digest of every micro-batch plus its real token ids."""
    out = []
    with MicroBatchConsumer(spec, index, liveness_timeout_s=10.0) as consumer:
        for batch in consumer:
            out.append((_digest(batch.buffer), real_tokens(batch.fields)))
    results.put((spec.name, index, out))


@pytest.mark.parametrize("kind", ["shm", "disk"])
def test_exactly_once_through_processes(kind, tmp_path):
    """DP2 x CP2 x TP2 with real reorganizer and consumer processes, over the shared-memory and
    the disk backend (both readable from the reorganizer processes).

    Every token of both mini-batches reaches exactly one (DP, CP) group exactly once; the two
    TP processes of a group receive bit-identical micro-batches; bytes read equal bytes stored.
    """
    rng = np.random.default_rng(7)
    metas = make_metas(rng.integers(50, 400, size=12).tolist())
    backend: UnitBackend = (
        SharedMemoryBackend(slab_bytes=4 << 20)
        if kind == "shm"
        else SafetensorsBackend(str(tmp_path / "shards"), shard_bytes=1 << 20)
    )
    fill_backend(backend, metas)
    topology = Topology(dp=2, cp=2, tp=2)
    plans = [plan_for(metas, topology, 256, f"mb{i}") for i in range(2)]
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    reorganizers, consumers = [], []
    try:
        for group in plans[0].consumers:
            spec = RingSpec.new(num_slots=2, slot_bytes=1 << 18, num_consumers=2)
            reorganizer = ReorganizerProcess(backend, spec)
            reorganizers.append(reorganizer)
            for plan in plans:
                reorganizer.submit(plan.minibatch_id, plan.consumer(group.dp_rank, group.cp_rank))
            reorganizer.finish(timeout_s=0)
            for index in range(2):
                process = ctx.Process(target=_consume, args=(spec, index, results))
                process.start()
                consumers.append(process)
        got = [results.get(timeout=120) for _ in consumers]
        for process in consumers:
            process.join(30)
            assert process.exitcode == 0
        by_ring: dict[str, dict[int, list]] = {}
        for name, index, out in got:
            by_ring.setdefault(name, {})[index] = out
        tokens = []
        for copies in by_ring.values():
            assert [d for d, _ in copies[0]] == [d for d, _ in copies[1]]
            half = len(copies[0]) // 2
            tokens.extend(t for _, t in copies[0][:half])
        assert np.array_equal(np.sort(np.concatenate(tokens)), _all_tokens(metas))
        # Scalars (reward) are read whole by every CP rank of the owning DP rank.
        cp = topology.cp
        units = list(backend.keys())
        needed = sum(backend.spec(k).nbytes * (cp if k.field == "reward" else 1) for k in units)
        assert sum(r.bytes_read for r in reorganizers) == 2 * needed
        figures = [r.metrics() for r in reorganizers]
        assert sum(f["knitkit/delivery/reorganizer_bytes_read"] for f in figures) == 2 * needed
        assert all(
            f["knitkit/delivery/reorganizer_fill_s"] == r.fill_s > 0
            for f, r in zip(figures, reorganizers, strict=True)
        )
        published = sum(f["knitkit/delivery/reorganizer_published"] for f in figures)
        assert published == sum(len(p.consumers[0].micro_batches) for p in plans) * len(figures)
    finally:
        for process in consumers:
            if process.is_alive():
                process.kill()
        for reorganizer in reorganizers:
            reorganizer.close()
        backend.close()


def _published(backend: UnitBackend, assignment, stale: bool) -> list[bytes]:
    """Every micro-batch of ``assignment`` as published into a fresh ring, whole (``nbytes``,
    alignment padding included); ``stale``: every slot first holds 0xFF bytes, as a ring does
    after other micro-batches."""
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 18, num_consumers=1)
    owner = SlotRing.create(spec)
    if stale:
        owner.slot(0, spec.slot_bytes)[:] = b"\xff" * spec.slot_bytes
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    consumer = MicroBatchConsumer(spec, 0)
    reorganizer = Reorganizer(backend, publisher)
    thread = threading.Thread(target=reorganizer.deliver, args=("mb", assignment))
    thread.start()
    out = []
    try:
        for _ in range(len(assignment.micro_batches)):
            with consumer.next_micro_batch(timeout_s=30) as lease:
                out.append(bytes(lease.buffer[: lease.layout.nbytes]))
    finally:
        thread.join(30)
        consumer.close()
        publisher.close()
        owner.close()
        owner.unlink()
    return out


def test_a_published_micro_batch_is_the_same_bytes_whatever_its_slot_held_before() -> None:
    """A packed micro-batch is a function of its plan alone, padding between fields included
    (fields start at 64-byte offsets): a slot that held other bytes carries none of them over,
    for backbone and encoder micro-batches. Otherwise a re-served micro-batch (a restarted
    reorganizer publishes into a fresh ring) differs from the first serving in those bytes. On
    480348c the alignment padding kept the slot's old bytes."""
    metas = make_metas([37, 5, 91, 12])
    backend = MemoryBackend()
    fill_backend(backend, metas)
    backbone = plan_for(metas, Topology(1, 1, 1), 64, "mb").consumer(0, 0)
    units = tuple(UnitKey(m.trajectory_id, "reward") for m in metas)
    encoder = EncoderRankPlan("vision", 0, (units[:3], units[3:]))
    for assignment in (backbone, encoder):
        fresh, stale = _published(backend, assignment, False), _published(backend, assignment, True)
        assert len(fresh) == len(assignment.micro_batches) >= 2
        assert fresh == stale, type(assignment).__name__


@pytest.mark.parametrize("kind", ["shm", "disk"])
def test_fill_time_is_counted_within_the_delivering_threads_cpu(kind, tmp_path) -> None:
    """NOTE [ Fill time ]: every micro-batch's fill adds its thread CPU to the ring's count, on
    the copy-list path (shared memory) and the template path (disk), for backbone and encoder
    assignments: the count grows with each assignment and never exceeds the CPU of the thread
    that delivered (the fill is part of it)."""
    metas = make_metas([300, 41, 177, 90, 250])
    backend: UnitBackend = (
        SharedMemoryBackend(slab_bytes=1 << 20)
        if kind == "shm"
        else SafetensorsBackend(str(tmp_path / "shards"), shard_bytes=1 << 20)
    )
    fill_backend(backend, metas)
    backbone = plan_for(metas, Topology(1, 1, 1), 128, "mb").consumer(0, 0)
    units = tuple(UnitKey(m.trajectory_id, "tokens") for m in metas)
    encoder = EncoderRankPlan("vision", 0, (units[:2], units[2:]))
    spec = RingSpec.new(num_slots=8, slot_bytes=1 << 18, num_consumers=1)
    try:
        with published_ring(spec) as ring:
            reorganizer = Reorganizer(backend, ring.publisher)
            for assignment in (backbone, encoder):
                assert len(assignment.micro_batches) <= spec.num_slots
                before_s, cpu_ns = ring.owner.fill_s, []

                def deliver(assignment=assignment, cpu_ns=cpu_ns) -> None:
                    began = time.thread_time_ns()
                    reorganizer.deliver("mb", assignment)
                    cpu_ns.append(time.thread_time_ns() - began)

                thread = threading.Thread(target=deliver)
                thread.start()
                thread.join(60)
                assert cpu_ns, "the delivery did not finish within 60 s"
                filled_ns = round((ring.owner.fill_s - before_s) * 1e9)
                assert 0 < filled_ns <= cpu_ns[0], (type(assignment).__name__, filled_ns, cpu_ns)
                for _ in assignment.micro_batches:
                    ring.consumers[0].next_micro_batch(timeout_s=30).release()
    finally:
        backend.close()
