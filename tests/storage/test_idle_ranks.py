"""Idle DP ranks: a mini-batch with fewer trajectories (or GRPO groups) than DP ranks still steps
every rank the same number of times, with valid empty micro-batches (issue 9, class 1)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
from delivery_payloads import ROUTING_ROW, make_metas, plan_for, real_tokens, trajectories
from hypothesis import given, settings
from hypothesis import strategies as st

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.backends.disk import SafetensorsBackend
from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer import Reorganizer
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.storage.planning.plan import MiniBatchPlan, Topology
from knitkit.storage.units.store import TrajectoryStore

EMPTY_SPECS = {
    "tokens": ("int32", (0,)),
    "logprobs": ("float32", (0,)),
    "routing": ("uint8", (0, *ROUTING_ROW)),
    "reward": ("float32", (0,)),
    "position_ids": ("int64", (0,)),
    "cu_seqlens": ("int32", (1,)),
}


def _registered(
    backend: UnitBackend, lengths: list[int], topology: Topology, budget: int | None, groups: bool
) -> tuple[TrajectoryStore, MiniBatchPlan]:
    metas = make_metas(lengths, group_size=2)
    store = TrajectoryStore(backend)
    for trajectory in trajectories(metas):
        store.write(trajectory)
    plan = plan_for(metas, topology, budget, "mb0", keep_groups=groups)
    return store, store.register(plan)


def _check(batches_by_consumer: dict[str, list[dict[str, np.ndarray]]], total: int) -> None:
    """Same micro-batch count everywhere; empty ones valid; every token exactly once per CP split."""
    counts = {len(b) for b in batches_by_consumer.values()}
    assert len(counts) == 1 and counts != {0}
    empty = 0
    tokens = []
    for batches in batches_by_consumer.values():
        for fields in batches:
            if len(fields["cu_seqlens"]) == 1:
                empty += 1
                got = {name: (fields[name].dtype.name, fields[name].shape) for name in EMPTY_SPECS}
                assert got == EMPTY_SPECS
                assert fields["cu_seqlens"].tolist() == [0]
            else:
                tokens.append(real_tokens(fields))
    assert empty > 0
    assert sum(len(t) for t in tokens) == total


@settings(max_examples=20, deadline=None)
@given(
    dp=st.integers(2, 4),
    cp=st.integers(1, 2),
    lengths=st.lists(st.integers(1, 120), min_size=1, max_size=3),
    budget=st.sampled_from([None, 64]),
    groups=st.booleans(),
)
def test_idle_ranks_get_valid_empty_micro_batches(dp, cp, lengths, budget, groups) -> None:
    """Random topologies with fewer trajectories (GRPO groups with ``keep_groups``) than DP ranks:
    every (DP, CP) consumer receives the same number of micro-batches; an idle rank's are valid
    empty layouts (each field with its dtype and row shape, zero rows, ``cu_seqlens == [0]``);
    every real token arrives exactly once."""
    if len(lengths) >= dp:
        lengths = lengths[: dp - 1]
    store, plan = _registered(MemoryBackend(), lengths, Topology(dp, cp), budget, groups)
    got: dict[str, list[dict[str, np.ndarray]]] = {}
    for group in plan.consumers:
        spec = RingSpec.new(num_slots=8, slot_bytes=1 << 16, num_consumers=1)
        owner = SlotRing.create(spec)
        publisher = Publisher(SlotRing.attach(spec))
        publisher.start()
        consumer = MicroBatchConsumer(spec, 0)
        try:
            Reorganizer(store.backend, publisher).deliver(plan.minibatch_id, group)
            publisher.finish()
            got[group.name] = [{k: v.copy() for k, v in batch.fields.items()} for batch in consumer]
        finally:
            consumer.close()
            publisher.close()
            owner.close()
            owner.unlink()
    _check(got, sum(lengths))


def _consume(spec: RingSpec, results: mp.Queue) -> None:
    with MicroBatchConsumer(spec, 0, liveness_timeout_s=60.0) as consumer:
        out = [{k: v.copy() for k, v in batch.fields.items()} for batch in consumer]
    results.put((spec.name, out))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shm", "disk"])
def test_idle_rank_through_reorganizer_processes(kind: str, tmp_path: Path) -> None:
    """End to end through ``ReorganizerProcess``: DP4 x CP1 with three trajectories, so one DP
    rank is idle; its consumer gets the same number of valid empty micro-batches as the others
    (no ``ReorganizerError``), every token arrives once."""
    backend: UnitBackend = (
        SharedMemoryBackend(slab_bytes=1 << 20)
        if kind == "shm"
        else SafetensorsBackend(str(tmp_path / "shards"), shard_bytes=1 << 20)
    )
    store, plan = _registered(backend, [90, 40, 70], Topology(dp=4), 64, False)
    assert any(not mb.sequences for c in plan.consumers for mb in c.micro_batches)
    if isinstance(backend, SafetensorsBackend):
        backend.flush()
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    reorganizers, consumers = [], []
    try:
        for group in plan.consumers:
            spec = RingSpec.new(num_slots=2, slot_bytes=1 << 16, num_consumers=1)
            reorganizer = ReorganizerProcess(backend, spec)
            reorganizers.append(reorganizer)
            reorganizer.submit(plan.minibatch_id, group)
            reorganizer.finish(timeout_s=0)
            process = ctx.Process(target=_consume, args=(spec, results))
            process.start()
            consumers.append(process)
        got = dict(results.get(timeout=120) for _ in consumers)
        for process in consumers:
            process.join(60)
            assert process.exitcode == 0
        _check(got, 200)
    finally:
        for process in consumers:
            if process.is_alive():
                process.kill()
        for reorganizer in reorganizers:
            reorganizer.close()
        store.close()
