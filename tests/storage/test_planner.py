"""The planner: DP balance, CP split, micro-batch counts and encoder plans, from metadata alone."""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitkit.storage import EncoderTopology, MiniBatchPlan, PlannerConfig, Topology, plan_minibatch
from knitkit.storage.baselines import planner_timing
from knitkit.storage.baselines.planner_timing import planner_figures, planner_ms
from knitkit.storage.baselines.synthetic import synthetic_metas
from knitkit.storage.planning.balance import karmarkar_karp, pack_ranks_by_budget
from knitkit.storage.planning.cp import cp_chunks
from knitkit.storage.planning.plan import SequenceSlice
from knitkit.types import MultimodalRef, TrajectoryMeta, UnitKey


@st.composite
def minibatches(draw: st.DrawFn) -> tuple[list[TrajectoryMeta], Topology, PlannerConfig]:
    topology = Topology(
        dp=draw(st.integers(1, 5)),
        cp=draw(st.integers(1, 3)),
        tp=draw(st.integers(1, 2)),
        sequence_parallel=draw(st.booleans()),
    )
    group = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(0, 300), max_size=18))
    images = draw(st.integers(1, 4))
    metas = [
        TrajectoryMeta(
            trajectory_id=f"t{i}",
            sample_id=f"s{i // group}",
            source="a",
            rollout_step=0,
            num_tokens=n,
            min_version=0,
            max_version=0,
            accepted=draw(st.booleans()) or i % 3 != 0,
            multimodal=(MultimodalRef(UnitKey(f"h{(i // group) % images}", "image"), 0, 0, 3.0),),
        )
        for i, n in enumerate(lengths)
    ]
    config = PlannerConfig(
        max_tokens_per_micro_batch=draw(st.one_of(st.none(), st.integers(16, 400))),
        min_micro_batches=draw(st.integers(1, 3)),
        keep_groups=draw(st.booleans()),
        encoder_max_cost_per_micro_batch=draw(st.one_of(st.none(), st.floats(3.0, 10.0))),
    )
    return metas, topology, config


@settings(max_examples=200, deadline=None)
@given(case=minibatches())
def test_plan_covers_every_token_once_with_equal_micro_batch_counts(case) -> None:
    """Each accepted trajectory on exactly one DP rank; its CP chunks tile [0, padded) exactly once;
    the same micro-batch count on every consumer; budgets hold for multi-sequence micro-batches."""
    metas, topology, config = case
    plan = plan_minibatch(metas, topology, config, (EncoderTopology("vision", dp=2),), "mb")
    accepted = {m.trajectory_id: m for m in metas if m.accepted}
    assert len(plan.consumers) == topology.dp * topology.cp
    assert len({len(c.micro_batches) for c in plan.consumers}) == 1
    assert plan.num_micro_batches >= config.min_micro_batches
    owner: dict[str, int] = {}
    covered: dict[str, list[tuple[int, int]]] = {t: [] for t in accepted}
    for consumer in plan.consumers:
        assert plan.consumer(consumer.dp_rank, consumer.cp_rank) is consumer
        for mb in consumer.micro_batches:
            budget = config.max_tokens_per_micro_batch
            if budget is not None and len(mb.sequences) > 1:
                assert mb.num_tokens <= budget
            for seq in mb.sequences:
                assert owner.setdefault(seq.trajectory_id, consumer.dp_rank) == consumer.dp_rank
                assert seq.padded_length % topology.pad_multiple == 0
                assert (
                    seq.padded_length - accepted[seq.trajectory_id].num_tokens
                    < topology.pad_multiple
                )
                covered[seq.trajectory_id] += seq.chunks
    for tid, chunks in covered.items():
        want = accepted[tid].num_tokens
        padded = -(-want // topology.pad_multiple) * topology.pad_multiple
        assert sorted(chunks) == _tile(sorted(chunks), padded), tid
        assert sum(b - a for a, b in chunks) == padded
    assert set(owner) == set(accepted)
    for dp in range(topology.dp):
        orders = {
            tuple(
                tuple(s.trajectory_id for s in mb.sequences)
                for mb in plan.consumer(dp, cp).micro_batches
            )
            for cp in range(topology.cp)
        }
        assert len(orders) == 1, (
            "every CP rank of a DP rank packs the same sequences in the same order"
        )
    if config.keep_groups:
        ranks_of_group: dict[str, set[int]] = {}
        for tid, rank in owner.items():
            ranks_of_group.setdefault(accepted[tid].sample_id, set()).add(rank)
        assert all(len(r) == 1 for r in ranks_of_group.values())
    assert MiniBatchPlan.from_json(plan.to_json()) == plan


def _tile(chunks: list[tuple[int, int]], padded: int) -> list[tuple[int, int]]:
    """The chunks if they tile [0, padded) without gaps or overlaps, else a sentinel."""
    position = 0
    for start, stop in chunks:
        if start != position:
            return [(-1, -1)]
        position = stop
    return chunks if position == padded else [(-1, -1)]


@settings(max_examples=100, deadline=None)
@given(case=minibatches(), encoder_dp=st.integers(1, 4))
def test_encoder_plan_encodes_each_unique_input_once(case, encoder_dp: int) -> None:
    """Unique multimodal units of accepted trajectories, each on exactly one encoder rank, balanced
    by cost, same encoder micro-batch count on every encoder rank."""
    metas, topology, config = case
    encoder = EncoderTopology("vision", dp=encoder_dp)
    plan = plan_minibatch(metas, topology, config, (encoder,))
    ranks = plan.encoder("vision").ranks
    assert len(ranks) == encoder_dp and len({len(r.micro_batches) for r in ranks}) == 1
    got = Counter(k for r in ranks for k in r.units)
    want = {ref.key for m in metas if m.accepted for ref in m.multimodal}
    assert set(got) == want and all(n == 1 for n in got.values())
    loads = [len(r.units) for r in ranks]
    assert max(loads, default=0) - min(loads, default=0) <= 1  # equal costs: counts within one
    assert [r.name for r in ranks] == [f"vision/dp{i}" for i in range(encoder_dp)]


def test_dp_balance_evens_out_quadratic_cost() -> None:
    """On a realistic mini-batch the heaviest DP rank's cost is within 5% of the mean."""
    metas = synthetic_metas(512, group_size=8, seed=3)
    config = PlannerConfig(max_tokens_per_micro_batch=65536)
    plan = plan_minibatch(metas, Topology(dp=8, cp=2), config)
    costs = []
    for dp in range(8):
        lengths = [s.num_tokens for mb in plan.consumer(dp, 0).micro_batches for s in mb.sequences]
        costs.append(float(config.cost(np.array(lengths)).sum()))
    assert max(costs) / (sum(costs) / len(costs)) < 1.05


def test_planner_ms_measures_the_contract_topology() -> None:
    """planner_ms plans DP32 x CP2 x TP4 for 4096 trajectories and returns a positive time."""
    assert planner_ms(repeats=1) > 0.0


def test_planner_figures_come_from_a_fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """planner_figures reports the contract's two planner keys, timed in a spawned child process: nothing
    is planned in this process (a counting planner patched in here is never called)."""
    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> MiniBatchPlan:
        calls.append(1)
        return plan_minibatch(*args, **kwargs)

    monkeypatch.setattr(planner_timing, "plan_minibatch", counting)
    assert planner_timing.planner_ms(64, Topology(dp=2), repeats=1) > 0.0 and calls  # the spy works
    calls.clear()
    figures = planner_figures(repeats=1)
    assert set(figures) == {"planner_ms", "planner_ms.dp128_16k"}
    assert all(value > 0.0 for value in figures.values())
    assert not calls


def test_planner_leaves_the_garbage_collector_as_it_found_it() -> None:
    """plan_minibatch pauses the collector while it runs (NOTE [ planner and the garbage
    collector ]) and restores its state: on stays on, off (the caller's choice) stays off."""
    metas = synthetic_metas(64, group_size=8)
    assert gc.isenabled()
    plan_minibatch(metas, Topology(dp=4, cp=2))
    assert gc.isenabled()
    gc.disable()
    try:
        plan_minibatch(metas, Topology(dp=4, cp=2))
        assert not gc.isenabled()
    finally:
        gc.enable()


@settings(max_examples=100, deadline=None)
@given(case=minibatches(), encoder_dp=st.integers(1, 4))
def test_planner_fast_paths_equal_a_plain_reference(case, encoder_dp: int) -> None:
    """The planner's vectorised and fast-constructed parts equal a straightforward reference: every
    slice equals ``SequenceSlice(...)`` built from its trajectory's metadata and ``cp_chunks``, and
    the encoder plan equals one keyed by ``UnitKey`` itself, sorted by its order, costs rounded
    up with ``np.ceil``."""
    metas, topology, config = case
    encoder = EncoderTopology("vision", dp=encoder_dp)
    plan = plan_minibatch(metas, topology, config, (encoder,))
    by_id = {m.trajectory_id: m for m in metas}
    multiple = topology.pad_multiple * config.pad_multiple
    for consumer in plan.consumers:
        for mb in consumer.micro_batches:
            for seq in mb.sequences:
                meta = by_id[seq.trajectory_id]
                padded = -(-meta.num_tokens // multiple) * multiple
                chunks = cp_chunks(padded, topology.cp, consumer.cp_rank)
                want = SequenceSlice(
                    meta.trajectory_id, meta.num_tokens, padded, chunks, meta.multimodal
                )
                assert seq == want and type(seq) is SequenceSlice
    accepted = [m for m in metas if m.accepted]
    costs: dict[UnitKey, float] = {}
    for meta in accepted:
        for ref in meta.multimodal:
            if ref.key.field in encoder.kinds:
                costs.setdefault(ref.key, ref.cost or float(ref.num_tokens))
    keys = sorted(costs)
    per_rank = karmarkar_karp([costs[k] for k in keys], encoder_dp)
    budget = config.encoder_max_cost_per_micro_batch
    micro = pack_ranks_by_budget(
        [[int(np.ceil(costs[keys[i]])) for i in items] for items in per_rank],
        None if budget is None else int(np.ceil(budget)),
    )
    want_ranks = [
        tuple(tuple(keys[items[j]] for j in bin_) for bin_ in micro[r])
        for r, items in enumerate(per_rank)
    ]
    assert [r.micro_batches for r in plan.encoder("vision").ranks] == want_ranks
