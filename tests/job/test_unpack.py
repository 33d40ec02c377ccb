"""Write-back's pure inverse: ``MicroBatchPlan.unpack`` undoes packing and the CP split exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from knitkit.storage import MemoryBackend, PlannerConfig, Topology, TrajectoryStore, plan_minibatch
from knitkit.storage.baselines import synthetic_trajectories
from knitkit.storage.planning import pack
from knitkit.types import UnitKey


@settings(max_examples=60, deadline=None)
@given(
    dp=st.integers(1, 3),
    cp=st.integers(1, 3),
    tp=st.integers(1, 2),
    sequence_parallel=st.booleans(),
    pad_multiple=st.sampled_from([1, 4]),
    num_samples=st.integers(1, 4),
    budget=st.sampled_from([None, 64, 160]),
    seed=st.integers(0, 10_000),
)
def test_unpack_is_the_exact_inverse_of_packing(
    dp: int,
    cp: int,
    tp: int,
    sequence_parallel: bool,
    pad_multiple: int,
    num_samples: int,
    budget: int | None,
    seed: int,
) -> None:
    """For random plans (DP, CP, TP with sequence parallelism, extra padding, token budgets, idle
    DP ranks): packing a per-token field on every consumer and unpacking each packed buffer gives,
    per trajectory, disjoint ranges that cover every real token exactly once, with the stored
    rows bit-identical; padding rows never come back."""
    store = TrajectoryStore(MemoryBackend())
    trajectories = synthetic_trajectories(
        num_samples, group_size=3, min_tokens=1, max_tokens=120, seed=seed
    )
    for trajectory in trajectories:
        store.write(trajectory)
    topology = Topology(dp=dp, cp=cp, tp=tp, sequence_parallel=sequence_parallel)
    config = PlannerConfig(
        token_fields=("tokens", "routing"),
        scalar_fields=(),
        max_tokens_per_micro_batch=budget,
        pad_multiple=pad_multiple,
    )
    plan = store.register(plan_minibatch(store.metas(), topology, config, minibatch_id="mb"))
    seen = {t.trajectory_id: np.zeros(t.num_tokens, np.int64) for t in trajectories}
    for consumer in plan.consumers:
        for micro_batch in consumer.micro_batches:
            layout, buffer = pack(micro_batch, consumer.row_specs, store.read_into)
            views = layout.numpy_views(buffer)
            for field in ("tokens", "routing"):
                for piece in micro_batch.unpack(views[field]):
                    original = store.read(UnitKey(piece.trajectory_id, field))
                    expected = np.concatenate([original[a:b] for a, b in piece.ranges])
                    assert piece.rows.dtype == original.dtype
                    np.testing.assert_array_equal(piece.rows, expected)
                    starts = [a for a, _ in piece.ranges]
                    assert starts == sorted(starts)
                    assert all(b <= len(original) for _, b in piece.ranges)
                    if field == "tokens":
                        for a, b in piece.ranges:
                            seen[piece.trajectory_id][a:b] += 1
    for tid, counts in seen.items():
        assert (counts == 1).all(), f"{tid}: tokens unpacked {sorted(set(counts.tolist()))} times"


def test_unpack_refuses_rows_that_do_not_match_the_packed_tokens() -> None:
    """A wrong row count (e.g. values of another micro-batch) is refused, naming the counts."""
    store = TrajectoryStore(MemoryBackend())
    for trajectory in synthetic_trajectories(1, group_size=2, seed=1):
        store.write(trajectory)
    plan = plan_minibatch(store.metas(), Topology(dp=1, cp=2), PlannerConfig(), minibatch_id="m")
    micro_batch = plan.consumers[0].micro_batches[0]
    try:
        micro_batch.unpack(np.zeros(micro_batch.num_tokens + 1))
    except ValueError as error:
        assert f"packs {micro_batch.num_tokens} tokens" in str(error)
    else:
        raise AssertionError("unpack accepted a wrong row count")


def test_with_fields_keeps_the_plan_and_restricts_the_fields() -> None:
    """``with_fields`` serves a pass from the one plan: the same sequences and chunks, only the
    pass's fields (in planned order), the schema restricted alike; unknown fields are named."""
    store = TrajectoryStore(MemoryBackend())
    for trajectory in synthetic_trajectories(2, group_size=2, seed=2):
        store.write(trajectory)
    config = PlannerConfig(
        token_fields=("tokens", "logprobs", "routing"), scalar_fields=("reward",)
    )
    plan = store.register(plan_minibatch(store.metas(), Topology(dp=2, cp=2), config, (), "m"))
    restricted = plan.with_fields(["routing", "tokens", "reward"])
    for full, mine in zip(plan.consumers, restricted.consumers, strict=True):
        assert {f.name for f in mine.schema} == {"routing", "tokens", "reward"}
        for a, b in zip(full.micro_batches, mine.micro_batches, strict=True):
            assert a.sequences is b.sequences
            assert b.token_fields == ("tokens", "routing") and b.scalar_fields == ("reward",)
    try:
        plan.with_fields(["tokens", "values"])
    except ValueError as error:
        assert "['values']" in str(error)
    else:
        raise AssertionError("with_fields accepted a field the plan does not carry")
