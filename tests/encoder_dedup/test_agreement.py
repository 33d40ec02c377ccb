"""Ranks agree before rows move (issue 10, failures 3 and 4), on real gloo worlds.

A rank whose routing plan differs from its peers' (so a receive buffer would be short and keep
uninitialised rows) and a rank that skips ``backward()`` must give a knitkit error on every rank
that names the ranks and what differs, within a bound, instead of training on garbage or
waiting for the process-group timeout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest
import torch
from dist import World, run_world

from encoder_dedup.harness import WatchedTransport
from knitkit.encoder_dedup import (
    BackboneAssignment,
    DedupEncoder,
    EncoderAssignment,
    ProcessGroupTransport,
    RoutingPlan,
    RowSlice,
    build_routing_plan,
)
from knitkit.types import UnitKey

A, B = UnitKey("a", "image"), UnitKey("b", "image")
HIDDEN = 2
WORLD_TIMEOUT_S = 120.0
"""Default limit of one job on this module's lent world (``world2`` in tests/conftest.py)."""


def _plan(rank_one_wants_more: bool) -> RoutingPlan:
    """Rank 0 encodes A, rank 1 encodes B; both consume both. Optionally rank 1 wants more of A."""
    wanted_a = 4 if rank_one_wants_more else 3
    encoder = EncoderAssignment({0: [[A]], 1: [[B]]}, {A: 4, B: 2})
    backbone = BackboneAssignment(
        {
            0: [[RowSlice(A, 0, 3), RowSlice(B, 0, 2)]],
            1: [[RowSlice(A, 0, wanted_a), RowSlice(B, 0, 2)]],
        }
    )
    return build_routing_plan(encoder, backbone, world_size=2)


def _encoder(rank: int, plan: RoutingPlan, timeout_s: float = 60.0) -> DedupEncoder:
    return DedupEncoder(
        plan.for_rank(rank), ProcessGroupTransport(), hidden=HIDDEN, handshake_timeout_s=timeout_s
    )


def _encode_fn(rank: int) -> Callable[[Sequence[UnitKey]], torch.Tensor]:
    weight = torch.nn.Parameter(torch.ones(1, HIDDEN))
    return lambda keys: weight.expand(4 if keys[0] == A else 2, HIDDEN) * (rank + 1)


def _different_plans(rank: int) -> str:
    """Rank 1 plans with a different view of the mini-batch: the error text on this rank."""
    dedup = _encoder(rank, _plan(rank_one_wants_more=rank == 1))
    try:
        dedup.encode(_encode_fn(rank))
    except RuntimeError as error:
        return str(error)
    return "no error; cache: " + str(dedup.features(0).tolist())


def _skips_backward(rank: int) -> str:
    """Rank 1 skips backward() and starts the next mini-batch: the error text on this rank."""
    plan = _plan(rank_one_wants_more=False)
    dedup = _encoder(rank, plan)
    dedup.encode(_encode_fn(rank))
    dedup.features(0).sum().backward()
    try:
        if rank == 0:
            dedup.backward()
        else:
            _encoder(rank, plan).encode(_encode_fn(rank))
    except RuntimeError as error:
        return str(error)
    return "no error"


def _skips_backward_and_stops(rank: int, timeout_s: float) -> str:
    """Rank 1 skips backward() and does nothing else: rank 0's error text (bounded wait)."""
    dedup = _encoder(rank, _plan(rank_one_wants_more=False), timeout_s)
    dedup.encode(_encode_fn(rank))
    dedup.features(0).sum().backward()
    if rank == 1:
        return "skipped"
    try:
        dedup.backward()
    except TimeoutError as error:
        return str(error)
    return "no error"


def _same_plans(rank: int) -> list[list[float]]:
    dedup = _encoder(rank, _plan(rank_one_wants_more=False))
    dedup.encode(_encode_fn(rank))
    features = dedup.features(0)
    features.sum().backward()
    dedup.backward()
    return features.tolist()


def test_agreeing_plans_move_rows(world2: World) -> None:
    """The handshake lets agreeing ranks through: features are rank 0's A rows then rank 1's B rows."""
    for features in world2.run(_same_plans):
        assert features == [[1.0, 1.0]] * 3 + [[2.0, 2.0]] * 2


def test_different_plans_raise_on_every_rank(world2: World) -> None:
    """Plans that differ raise on every rank before any row moves, naming both ranks and the counts."""
    for rank, message in enumerate(world2.run(_different_plans)):
        assert "routing plans differ" in message, (rank, message)
        assert "ranks [0]" in message and "ranks [1]" in message, message
        assert "rank 0 sends 3 forward rows to rank 1, which expects 4" in message, message


def test_rank_that_skips_backward_is_named(world2: World) -> None:
    """A rank that skips backward() and starts the next encode: both ranks name the phases."""
    for message in world2.run(_skips_backward):
        assert "rank 0 is in phase 'backward' while rank 1 is in phase 'encode'" in message, message


@pytest.mark.slow
def test_rank_that_skips_backward_times_out_with_knitkit_error() -> None:
    """A rank that skips backward() and stops: its peer fails within the configured bound, naming the phase."""
    limit = 2.0  # the peer can never arrive, so a short bound cannot flake on a loaded machine
    message = run_world(_skips_backward_and_stops, 2, limit, timeout_s=180)[0]
    assert "'backward'" in message and "within 2 s" in message, message


@dataclasses.dataclass(slots=True)
class _Counted(WatchedTransport):
    """A rank's real transport, counting its handshake exchanges (int64 rows) and row exchanges."""

    handshakes: int = 0
    rows: int = 0

    def before(self, rows: bool) -> None:
        if rows:
            self.rows += 1
        else:
            self.handshakes += 1


def _counted_step(rank: int, plan: RoutingPlan) -> tuple[int, int, list[list[float]]]:
    """One encode, backbone backward and deferred backward over a counting transport."""
    transport = _Counted(ProcessGroupTransport())
    dedup = DedupEncoder(plan.for_rank(rank), transport, hidden=HIDDEN, handshake_timeout_s=60)
    dedup.encode(_encode_fn(rank))
    features = dedup.features(0)
    features.sum().backward()
    dedup.backward()
    return transport.handshakes, transport.rows, features.tolist()


def test_agreeing_plans_shake_hands_once_per_phase(world2: World) -> None:
    """Ranks that hold one routing plan (its fingerprint vouches for every row count) agree in
    one handshake exchange per phase, not two (NOTE [ One round when the plan vouches ]), and
    move the same rows as before."""
    plan = _plan(rank_one_wants_more=False)
    for handshakes, rows, features in world2.run(_counted_step, plan):
        assert (handshakes, rows) == (2, 2)
        assert features == [[1.0, 1.0]] * 3 + [[2.0, 2.0]] * 2


def _hand_built(rank: int, plan: RoutingPlan) -> int:
    """Routes without a fingerprint: the handshake keeps both rounds; returns the exchange count."""
    route = dataclasses.replace(plan.for_rank(rank), plan_fingerprint=b"")
    transport = _Counted(ProcessGroupTransport())
    dedup = DedupEncoder(route, transport, hidden=HIDDEN, handshake_timeout_s=60)
    dedup.encode(_encode_fn(rank))
    return transport.handshakes


def test_routes_without_a_fingerprint_keep_both_rounds(world2: World) -> None:
    """A hand-built route carries no plan fingerprint, so nothing vouches for its counts: every
    rank runs the second round that tells each rank every disagreement."""
    assert world2.run(_hand_built, _plan(rank_one_wants_more=False)) == [2, 2]


def _counts_differ_under_one_plan(rank: int) -> str:
    """Rank 1's route expects one row fewer from rank 0, under the same fingerprint."""
    route = _plan(rank_one_wants_more=False).for_rank(rank)
    if rank == 1:
        forward = route.forward
        counts = (forward.recv_counts[0] - 1, *forward.recv_counts[1:])
        route = dataclasses.replace(route, forward=dataclasses.replace(forward, recv_counts=counts))
    dedup = DedupEncoder(route, ProcessGroupTransport(), hidden=HIDDEN, handshake_timeout_s=60)
    try:
        dedup.encode(_encode_fn(rank))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_counts_that_differ_under_one_plan_are_named(world2: World) -> None:
    """Counts that differ although the fingerprints agree (routes built by different code)
    raise ``RouteMismatch`` on both ranks of the pair before any row moves, naming the counts."""
    for message in world2.run(_counts_differ_under_one_plan):
        assert "routes of the same plan" in message, message
        assert "rank 0 sends 3 forward rows to rank 1, which expects 2" in message, message
