"""The routing plan: every consumed row arrives from its encoding rank; every gradient row returns exactly once."""

from __future__ import annotations

import pytest
import torch

from knitkit.encoder_dedup import (
    BackboneAssignment,
    EncoderAssignment,
    RankRoute,
    RowSlice,
    build_rank_route,
    build_routing_plan,
    row_slices,
)
from knitkit.types import MultimodalRef, UnitKey

A, B, C = UnitKey("a", "image"), UnitKey("b", "image"), UnitKey("c", "video")
ROWS = {A: 4, B: 3, C: 5}


def _simulate(plan, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run both exchanges on row ids: forward caches and the gradient rows each encoder receives."""
    tables = []
    for rank in range(world):
        route = plan.for_rank(rank)
        tables.append(torch.arange(route.table_rows) + 1000 * rank)
    caches, returned = [], [torch.zeros(plan.for_rank(r).table_rows) for r in range(world)]
    sent = [
        tables[r][plan.for_rank(r).forward.send_index].split(plan.for_rank(r).forward.send_counts)
        for r in range(world)
    ]
    for rank in range(world):
        fwd = plan.for_rank(rank).forward
        cache = torch.full((plan.for_rank(rank).cache_rows,), -1)
        cache[fwd.recv_index] = torch.cat([sent[src][rank] for src in range(world)])
        caches.append(cache)
    grads = [
        torch.ones(plan.for_rank(r).cache_rows)[plan.for_rank(r).backward.send_index].split(
            plan.for_rank(r).backward.send_counts
        )
        for r in range(world)
    ]
    for rank in range(world):
        bwd = plan.for_rank(rank).backward
        returned[rank].index_add_(
            0, bwd.recv_index, torch.cat([grads[src][rank] for src in range(world)])
        )
    return caches, returned


def test_rows_reach_consumers_and_gradients_count_each_consumer_once() -> None:
    """DP consumers each get exactly their rows; a TP pair returns every row once, not twice."""
    encoder = EncoderAssignment({0: [[A, B]], 1: [[C]]}, ROWS)
    mb_dp0 = [[RowSlice(A, 0, 4), RowSlice(C, 1, 3)], [RowSlice(A, 0, 4)]]
    mb_dp1 = [[RowSlice(B, 0, 3), RowSlice(A, 2, 4)]]
    backbone = BackboneAssignment({0: mb_dp0, 1: mb_dp0, 2: mb_dp1}, tp_groups=[[0, 1]])
    plan = build_routing_plan(encoder, backbone, world_size=3)
    caches, returned = _simulate(plan, 3)
    # rank 0 caches A rows 0..3 (table rows 0..3) and C rows 1..2 (rank 1's table rows 1..2)
    assert caches[0].tolist() == [0, 1, 2, 3, 1001, 1002]
    assert torch.equal(caches[0], caches[1])
    assert sorted(caches[2].tolist()) == [2, 3, 4, 5, 6]
    first = plan.for_rank(0).micro_batch_index
    assert [ix.tolist() for ix in first] == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3]]
    # every consumer contributes once per row it consumes: A rows 2,3 by DP0 and DP1, the rest once
    assert returned[0].tolist() == [1, 1, 2, 2, 1, 1, 1]
    assert returned[1].tolist() == [0, 1, 1, 0, 0]
    owned = [plan.for_rank(r).backward.send_counts for r in (0, 1)]
    assert sum(map(sum, owned)) == 6 and all(sum(o) == 3 for o in owned)


def _same_route(a: RankRoute, b: RankRoute) -> bool:
    tensors = ("micro_batch_index",)
    plain = [f for f in RankRoute.__slots__ if f not in (*tensors, "forward", "backward")]
    return (
        all(getattr(a, f) == getattr(b, f) for f in plain)
        and len(a.micro_batch_index) == len(b.micro_batch_index)
        and all(
            torch.equal(x, y) for x, y in zip(a.micro_batch_index, b.micro_batch_index, strict=True)
        )
        and all(
            getattr(a, d).send_counts == getattr(b, d).send_counts
            and getattr(a, d).recv_counts == getattr(b, d).recv_counts
            and torch.equal(getattr(a, d).send_index, getattr(b, d).send_index)
            and torch.equal(getattr(a, d).recv_index, getattr(b, d).recv_index)
            for d in ("forward", "backward")
        )
    )


def test_one_rank_route_is_the_plan_route_of_that_rank() -> None:
    """``build_rank_route`` (what a rank builds for itself each mini-batch, without the other
    ranks' indices) gives exactly the plan's route of that rank, fingerprint included."""
    encoder = EncoderAssignment({0: [[A, B]], 1: [[C]]}, ROWS)
    mb_dp0 = [[RowSlice(A, 0, 4), RowSlice(C, 1, 3)], [RowSlice(A, 0, 4)]]
    mb_dp1 = [[RowSlice(B, 0, 3), RowSlice(A, 2, 4)]]
    backbone = BackboneAssignment({0: mb_dp0, 1: mb_dp0, 2: mb_dp1}, tp_groups=[[0, 1]])
    plan = build_routing_plan(encoder, backbone, world_size=4)  # rank 3 idles
    for rank in range(4):
        route = build_rank_route(encoder, backbone, 4, rank)
        assert _same_route(route, plan.for_rank(rank)), rank
    with pytest.raises(ValueError, match="rank 4 outside the world of 4 ranks"):
        build_rank_route(encoder, backbone, 4, 4)


def test_row_slices_follow_sequence_ranges() -> None:
    """A CP rank or a micro-batch piece needs exactly the rows whose positions it holds, in order."""
    refs = (MultimodalRef(A, 2, 4), MultimodalRef(C, 8, 5))
    assert row_slices(refs, [(0, 6), (10, 12)]) == (
        RowSlice(A, 0, 4),
        RowSlice(C, 2, 4),
    )
    assert row_slices(refs, [(4, 9)]) == (RowSlice(A, 2, 4), RowSlice(C, 0, 1))
    assert row_slices(refs, [(14, 20)]) == ()


@pytest.mark.parametrize(
    ("encoder", "backbone", "match"),
    [
        (EncoderAssignment({0: [[A]], 1: [[A]]}, ROWS), BackboneAssignment({}), "exactly one"),
        (
            EncoderAssignment({0: [[A]]}, ROWS),
            BackboneAssignment({0: [[RowSlice(B, 0, 1)]]}),
            "no encoder",
        ),
        (
            EncoderAssignment({0: [[A]]}, ROWS),
            BackboneAssignment({0: [[RowSlice(A, 2, 9)]]}),
            "has 4 rows",
        ),
        (
            EncoderAssignment({0: [[A]]}, ROWS),
            BackboneAssignment({0: [[RowSlice(A, 0, 1)]], 1: [[]]}, tp_groups=[[0, 1]]),
            "identical",
        ),
    ],
)
def test_inconsistent_assignments_are_rejected(encoder, backbone, match) -> None:
    """Double encoding, unknown units, out-of-range rows and diverging TP replicas name the culprit."""
    with pytest.raises(ValueError, match=match):
        build_routing_plan(encoder, backbone, world_size=2)
