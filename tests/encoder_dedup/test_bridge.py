"""The storage plan -> routing bridge: every backbone micro-batch receives exactly its rows."""

from __future__ import annotations

import pytest
import torch

from encoder_dedup.test_plan import _same_route
from knitkit.encoder_dedup import RoutingPlan, feature_slices, route_minibatch, route_rank
from knitkit.encoder_dedup import plan as routing
from knitkit.encoder_dedup.assignment import RowSlice
from knitkit.storage import EncoderTopology, MiniBatchPlan, PlannerConfig, Topology, plan_minibatch
from knitkit.types import MultimodalRef, TrajectoryMeta, UnitKey


def _metas(samples: int, group: int) -> list[TrajectoryMeta]:
    """GRPO groups sharing one image per sample (plus a second one on odd samples)."""
    out = []
    for s in range(samples):
        refs = [MultimodalRef(UnitKey(f"img{s}", "image"), 3, 5 + s, cost=5.0 + s)]
        if s % 2:
            refs.append(MultimodalRef(UnitKey(f"vid{s}", "video"), 20, 7, cost=7.0))
        for t in range(group):
            out.append(
                TrajectoryMeta(
                    f"t{s}.{t}", f"s{s}", "src", 0, 40 + 9 * t + s, 0, 0, True, tuple(refs)
                )
            )
    return out


def _plan(topology: Topology, encoder_dp: int) -> MiniBatchPlan:
    config = PlannerConfig(token_fields=("tokens",), max_tokens_per_micro_batch=128)
    encoders = (EncoderTopology("vision", dp=encoder_dp, tp=topology.tp),)
    return plan_minibatch(_metas(6, 4), topology, config, encoders, "mb")


def _unit_rows(key: UnitKey, rows: int) -> torch.Tensor:
    """A unit's encoding with rows that name the unit and the row (for checking where they land)."""
    ident = float(sum(map(ord, str(key))))
    return torch.stack([torch.tensor([ident, float(r)]) for r in range(rows)])


def _forward_caches(routing: RoutingPlan, num_rows: dict[UnitKey, int]) -> list[torch.Tensor]:
    """Run every rank's forward exchange in one process: encoding tables -> consumer caches."""
    world = len(routing.routes)
    tables = [
        torch.cat([_unit_rows(k, num_rows[k]) for mb in r.encoder_micro_batches for k in mb])
        if r.encoder_micro_batches
        else torch.zeros(0, 2)
        for r in routing.routes
    ]
    caches = [torch.full((r.cache_rows, 2), -1.0) for r in routing.routes]
    for src, route in enumerate(routing.routes):
        sent = route.forward.send_index.split(list(route.forward.send_counts))
        for dst in range(world):
            recv = routing.routes[dst].forward
            placed = recv.recv_index.split(list(recv.recv_counts))[src]
            caches[dst][placed] = tables[src][sent[dst]]
    return caches


@pytest.mark.parametrize(
    ("dp", "cp", "tp", "encoder_dp"), [(2, 2, 1, 3), (1, 2, 2, 2), (2, 1, 1, 1)]
)
def test_routes_deliver_each_micro_batch_its_feature_rows(dp, cp, tp, encoder_dp):
    """From a real storage plan: every unique unit is encoded exactly once, no encoder
    micro-batch is empty, TP replicas get identical routes and return each gradient row once
    between them, and after the forward exchange each backbone micro-batch gathers exactly the
    rows ``feature_slices`` names, in order."""
    topology = Topology(dp, cp, tp)
    plan = _plan(topology, encoder_dp)
    world = dp * cp * tp
    coords = [(d, c, t) for d in range(dp) for c in range(cp) for t in range(tp)]
    backbone = {r: plan.consumer(d, c) for r, (d, c, _) in enumerate(coords)}
    encoder_ranks = [r * world // encoder_dp for r in range(encoder_dp)]
    routing = route_minibatch(
        backbone, plan.encoder("vision").ranks, world_size=world, encoder_ranks=encoder_ranks
    )
    encoded = [k for r in routing.routes for mb in r.encoder_micro_batches for k in mb]
    num_rows = {
        ref.key: ref.num_tokens
        for c in plan.consumers
        for mb in c.micro_batches
        for s in mb.sequences
        for ref in s.multimodal
    }
    assert sorted(encoded) == sorted(num_rows)
    assert all(mb for r in routing.routes for mb in r.encoder_micro_batches)
    assert {r.rank for r in routing.routes if r.encoder_micro_batches} <= set(encoder_ranks)
    returned = sum(sum(r.backward.send_counts) for r in routing.routes)
    assert returned == sum(
        routing.for_rank(r).cache_rows for r, c in enumerate(coords) if c[2] == 0
    )
    caches = _forward_caches(routing, num_rows)
    for rank, (d, c, t) in enumerate(coords):
        route = routing.for_rank(rank)
        micro_batches = plan.consumer(d, c).micro_batches
        assert len(route.micro_batch_index) == len(micro_batches)
        for index, mb in zip(route.micro_batch_index, micro_batches, strict=True):
            pieces = feature_slices(mb)
            expected = [_unit_rows(p.key, num_rows[p.key])[p.start : p.stop] for p in pieces]
            want = torch.cat(expected) if expected else torch.zeros(0, 2)
            torch.testing.assert_close(caches[rank][index], want)
        if t:
            first = routing.for_rank(rank - t)
            assert all(
                torch.equal(a, b)
                for a, b in zip(route.micro_batch_index, first.micro_batch_index, strict=True)
            )


def test_encoder_placement_is_checked():
    """Placing encoder ranks outside the routed world is refused with the offending placement."""
    plan = _plan(Topology(1), encoder_dp=2)
    with pytest.raises(ValueError, match=r"encoder_ranks=\[0, 5\]"):
        route_minibatch(
            {0: plan.consumer(0, 0)},
            plan.encoder("vision").ranks,
            world_size=1,
            encoder_ranks=[0, 5],
        )


def test_a_rank_route_lays_out_each_tp_group_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's own route (built each mini-batch on every rank, NOTE [ One rank's route ]) lays
    out each (DP, CP) consumer's cache once for its TP replicas, digests the plan without a
    dataclass ``repr`` per key and slice, and equals that rank's route of the whole plan."""
    plan = _plan(Topology(2, 1, 2), encoder_dp=4)
    coords = [(d, 0, t) for d in range(2) for t in range(2)]
    backbone = {r: plan.consumer(d, c) for r, (d, c, _) in enumerate(coords)}
    whole = route_minibatch(backbone, plan.encoder("vision").ranks, world_size=4)
    laid_out = []

    def counted(rank, micro_batches, num_rows):
        laid_out.append(rank)
        return cache_segments(rank, micro_batches, num_rows)

    def no_repr(self: object) -> str:
        raise AssertionError(f"repr of a {type(self).__name__} while routing")

    cache_segments = routing._cache_segments
    monkeypatch.setattr(routing, "_cache_segments", counted)
    for cls in (UnitKey, RowSlice):
        monkeypatch.setattr(cls, "__repr__", no_repr)
    for rank in range(4):
        laid_out.clear()
        route = route_rank(backbone, plan.encoder("vision").ranks, world_size=4, rank=rank)
        assert sorted(laid_out) == [0, 2], rank  # one per TP group, not one per rank
        assert _same_route(route, whole.for_rank(rank)), rank
