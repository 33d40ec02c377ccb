"""Vectorised THD packing (one batched read, array-wide padding / positions / masks) against the
per-sequence reference it replaced."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from knitkit.storage import MemoryBackend, PlannerConfig, Topology, TrajectoryStore, plan_minibatch
from knitkit.storage.baselines.synthetic import synthetic_trajectories
from knitkit.storage.planning import pack_into, pack_layout
from knitkit.storage.planning.packing import pack_into_batched
from knitkit.storage.planning.plan import MicroBatchPlan
from knitkit.types import MicroBatchLayout, UnitKey, UnitRead


def _reference_pack_into(
    micro_batch: MicroBatchPlan, layout: MicroBatchLayout, buffer: np.ndarray, backend
) -> dict[str, np.ndarray]:
    """The per-sequence packing loop as it was before vectorisation (one read per unit)."""
    views = layout.numpy_views(buffer)
    generated_mask = "loss_mask" not in micro_batch.token_fields
    offset = 0
    for i, seq in enumerate(micro_batch.sequences):
        ranges = seq.read_ranges
        real = sum(b - a for a, b in ranges)
        end = offset + seq.local_length
        for name in micro_batch.token_fields:
            key = UnitKey(seq.trajectory_id, name)
            backend.read(key, ranges, out=views[name][offset : offset + real])
            views[name][offset + real : end] = 0
        for name in micro_batch.scalar_fields:
            target = views[name][i : i + 1].reshape(views[name].shape[1:])
            backend.read(UnitKey(seq.trajectory_id, name), None, out=target)
        pos = offset
        for start, stop in seq.chunks:
            views["position_ids"][pos : pos + stop - start] = np.arange(start, stop)
            pos += stop - start
        if generated_mask:
            views["loss_mask"][offset : offset + real] = 1.0
            views["loss_mask"][offset + real : end] = 0.0
        offset = end
    views["cu_seqlens"][:] = np.cumsum([0, *(s.num_tokens for s in micro_batch.sequences)])
    views["cu_seqlens_padded"][:] = layout.cu_seqlens_padded
    return views


@settings(max_examples=40, deadline=None)
@given(
    dp=st.integers(1, 3),
    cp=st.integers(1, 4),
    sequence_parallel=st.booleans(),
    tp=st.integers(1, 2),
    num_samples=st.integers(1, 4),
    group_size=st.integers(1, 4),
    budget=st.one_of(st.none(), st.integers(8, 200)),
    stored_mask=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_vectorised_packing_equals_the_per_sequence_reference(
    dp, cp, sequence_parallel, tp, num_samples, group_size, budget, stored_mask, seed
) -> None:
    """For every micro-batch of every consumer, pack_into (per-unit reads) and pack_into_batched
    (one read_many) into DIRTY reused buffers give byte-identical fields to the old per-sequence
    loop into zeroed memory, stored or generated loss mask alike, and read the same bytes."""
    backend = MemoryBackend()
    store = TrajectoryStore(backend)
    for t in synthetic_trajectories(
        num_samples, group_size=group_size, min_tokens=1, max_tokens=90, seed=seed
    ):
        store.write(t)
    fields = (
        "tokens",
        "logprobs",
        "routing",
        "topp_mask",
        *(("loss_mask",) if stored_mask else ()),
    )
    topology = Topology(dp=dp, cp=cp, tp=tp, sequence_parallel=sequence_parallel)
    config = PlannerConfig(token_fields=fields, max_tokens_per_micro_batch=budget)
    plan = plan_minibatch(store.metas(), topology, config)
    schema = store.schema(store.index.trajectory_ids()[0])
    dirty = np.full(1 << 20, 0xAB, dtype=np.uint8)
    for consumer in plan.consumers:
        for mb in consumer.micro_batches:
            layout = pack_layout(mb, schema)
            before = backend.bytes_read
            want = _reference_pack_into(mb, layout, np.zeros(layout.nbytes, np.uint8), backend)
            reference_bytes = backend.bytes_read - before
            per_unit = pack_into(mb, layout, dirty, store.read_into)
            for name, view in want.items():
                np.testing.assert_array_equal(per_unit[name], view, err_msg=name)
            dirty[: layout.nbytes] = 0xCD
            before = backend.bytes_read
            batched = pack_into_batched(mb, layout, dirty, backend.read_many)
            assert backend.bytes_read - before == reference_bytes
            for name, view in want.items():
                np.testing.assert_array_equal(batched[name], view, err_msg=name)


def test_adjacent_chunks_are_read_as_one_run() -> None:
    """CP rank cp-1 owns chunks cp-1 and cp, which touch: the batched pack asks the backend for
    ONE range per unit there (one copy per contiguous run), two on the other ranks."""
    store = TrajectoryStore(MemoryBackend())
    for t in synthetic_trajectories(1, group_size=1, min_tokens=64, max_tokens=64):
        store.write(t)
    plan = plan_minibatch(store.metas(), Topology(dp=1, cp=2), PlannerConfig())
    schema = store.schema(store.index.trajectory_ids()[0])
    for cp_rank, runs in ((0, 2), (1, 1)):
        mb = plan.consumer(0, cp_rank).micro_batches[0]
        layout = pack_layout(mb, schema)
        seen: list[UnitRead] = []

        def record(reads, outs, seen=seen) -> None:
            seen.extend(reads)
            store.backend.read_many(reads, outs)

        pack_into_batched(mb, layout, np.zeros(layout.nbytes, np.uint8), record)
        assert {len(r.ranges) for r in seen if r.ranges is not None} == {runs}
