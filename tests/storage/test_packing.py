"""THD packing: every admitted token reaches exactly one (DP, CP) consumer once, fields sliced alike."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitkit.storage import (
    MemoryBackend,
    PlannerConfig,
    Topology,
    TrajectoryStore,
    pack,
    plan_minibatch,
)
from knitkit.storage.baselines.synthetic import synthetic_trajectories
from knitkit.storage.planning import pack_into, pack_layout
from knitkit.storage.planning.plan import MicroBatchPlan, SequenceSlice

FIELDS = ("tokens", "logprobs", "loss_mask", "routing", "topp_mask")


def _store(num_samples: int, group_size: int, seed: int) -> TrajectoryStore:
    store = TrajectoryStore(MemoryBackend())
    for t in synthetic_trajectories(
        num_samples, group_size=group_size, min_tokens=1, max_tokens=90, seed=seed
    ):
        store.write(t)
    return store


@settings(max_examples=60, deadline=None)
@given(
    dp=st.integers(1, 4),
    cp=st.integers(1, 3),
    sequence_parallel=st.booleans(),
    tp=st.integers(1, 2),
    num_samples=st.integers(1, 5),
    group_size=st.integers(1, 3),
    budget=st.one_of(st.none(), st.integers(8, 200)),
    keep_groups=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_every_token_reaches_exactly_one_consumer_once(
    dp, cp, sequence_parallel, tp, num_samples, group_size, budget, keep_groups, seed
) -> None:
    """Checksum over all packed micro-batches of all consumers: each real token exactly once, each
    per-token field equal to the stored field at the packed positions, padding zero, cu_seqlens right;
    the bytes read equal the bytes packed into per-token and scalar fields."""
    store = _store(num_samples, group_size, seed)
    topology = Topology(dp=dp, cp=cp, tp=tp, sequence_parallel=sequence_parallel)
    config = PlannerConfig(
        token_fields=FIELDS, max_tokens_per_micro_batch=budget, keep_groups=keep_groups
    )
    plan = plan_minibatch(store.metas(), topology, config)
    originals = {tid: store.read_trajectory(tid) for tid in store.index.trajectory_ids()}
    schema = store.schema(next(iter(originals)))
    before = store.bytes_read
    moved = 0
    seen = []
    for consumer in plan.consumers:
        for mb in consumer.micro_batches:
            layout, buffer = pack(mb, schema, store.read_into)
            views = layout.numpy_views(buffer)
            moved += sum(views[f].nbytes for f in (*FIELDS, "reward")) - _padding_bytes(mb, views)
            offset = 0
            for i, seq in enumerate(mb.sequences):
                positions = views["position_ids"][offset : offset + seq.local_length]
                real = positions < seq.num_tokens
                original = originals[seq.trajectory_id]
                for f in FIELDS:
                    packed = views[f][offset : offset + seq.local_length]
                    np.testing.assert_array_equal(packed[real], original[f][positions[real]])
                    assert not packed[~real].any()
                assert views["reward"][i] == original["reward"]
                seen.append(views["tokens"][offset : offset + seq.local_length][real])
                offset += seq.local_length
            padded = np.cumsum([0, *(s.padded_length for s in mb.sequences)])
            assert (
                views["cu_seqlens_padded"].tolist()
                == padded.tolist()
                == list(layout.cu_seqlens_padded)
            )
            assert (
                views["cu_seqlens"].tolist()
                == np.cumsum([0, *(s.num_tokens for s in mb.sequences)]).tolist()
            )
    got = np.sort(np.concatenate(seen)) if seen else np.zeros(0, dtype=np.int64)
    want = np.sort(np.concatenate([o["tokens"] for o in originals.values()]))
    np.testing.assert_array_equal(got, want)
    assert store.bytes_read - before == moved


def _padding_bytes(mb: MicroBatchPlan, views: dict[str, np.ndarray]) -> int:
    pad_rows = mb.num_tokens - sum(b - a for s in mb.sequences for a, b in s.read_ranges)
    return sum(views[f][:1].nbytes * pad_rows for f in FIELDS)


def test_layout_matches_megatron_thd_conventions() -> None:
    """cp=2: two chunks per sequence, position ids are the chunks, the mask is 1 on real tokens only;
    cu_seqlens are the whole padded sequences, as PackedSeqParams expects under CP."""
    store = _store(1, 1, seed=0)
    tid = store.index.trajectory_ids()[0]
    n = store.meta(tid).num_tokens
    padded = -(-n // 4) * 4
    size = padded // 4
    seq = SequenceSlice(tid, n, padded, ((size, 2 * size), (2 * size, 3 * size)))
    mb = MicroBatchPlan(3, (seq,), ("tokens", "routing"), ("reward",))
    layout, buffer = pack(mb, store.schema(tid), store.read_into)
    views = layout.numpy_views(buffer)
    assert views["position_ids"].tolist() == list(range(size, 3 * size))
    assert views["loss_mask"].tolist() == [1.0 if p < n else 0.0 for p in range(size, 3 * size)]
    assert layout.cu_seqlens_padded == (0, padded) and layout.trajectory_ids == (tid,)
    assert layout.extra["micro_batch"] == 3 and layout.extra["num_tokens"] == 2 * size
    assert views["routing"].shape == (2 * size, 4, 2) and views["reward"].shape == (1,)


def test_pack_into_a_reused_buffer_leaves_nothing_behind() -> None:
    """Packing into a dirty reused slot gives exactly the fields of a pack into zeroed memory."""
    store = _store(2, 2, seed=1)
    config = PlannerConfig(token_fields=FIELDS, min_micro_batches=2)
    plan = plan_minibatch(store.metas(), Topology(dp=1, cp=2), config)
    schema = store.schema(store.index.trajectory_ids()[0])
    slot = np.full(1 << 20, 0xAB, dtype=np.uint8)
    for mb in plan.consumer(0, 1).micro_batches:
        layout = pack_layout(mb, schema)
        dirty = pack_into(mb, layout, slot, store.read_into)
        clean = pack_into(mb, layout, np.zeros(layout.nbytes, dtype=np.uint8), store.read_into)
        assert dirty.keys() == clean.keys()
        for name in clean:
            np.testing.assert_array_equal(dirty[name], clean[name], err_msg=name)


def test_missing_schema_field_is_a_clear_error() -> None:
    """pack_layout names the fields it has no dtype/shape for."""
    mb = MicroBatchPlan(0, (), ("tokens", "routing"))
    with pytest.raises(KeyError, match="routing"):
        pack_layout(mb, {"tokens": ("int64", ())})
