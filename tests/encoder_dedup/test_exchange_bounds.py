"""Every exchange of the dedup encoder is bounded and names its phase and peer (issue 22, item 14).

A rank whose ``encode_fn`` raises (or returns rows of the wrong shape, or encodes forward-only
while its peers train) and then stays alive used to leave its peers blocked in the row exchange
until the process exited; they then got a raw gloo error. Now the failing rank tells its peers in
the handshake, so they raise at once with its error and the group stays usable for the next
mini-batch; a peer that stops after the handshake, or never arrives at it, is named in a
TimeoutError within ``handshake_timeout_s``. Real gloo worlds (``tests/dist.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

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
    RowTransport,
    build_routing_plan,
)
from knitkit.types import UnitKey

HIDDEN = 2
NEVER_S = 30.0
"""Handshake bound where every peer arrives: a prompt error must come well before it."""
OUTER_S = 100.0
"""Bound on a whole case: under the 120 s process-group timeout, so a hang fails the case."""
UNITS = [UnitKey(name, "image") for name in "abc"]


def _plan(world: int) -> RoutingPlan:
    """Rank r encodes unit r (r + 2 rows); every rank consumes every unit in one micro-batch."""
    rows = {UNITS[r]: r + 2 for r in range(world)}
    encoder = EncoderAssignment({r: [[UNITS[r]]] for r in range(world)}, rows)
    pieces = [RowSlice(key, 0, n) for key, n in rows.items()]
    backbone = BackboneAssignment({r: [pieces] for r in range(world)})
    return build_routing_plan(encoder, backbone, world_size=world)


def _dedup(
    rank: int, world: int, timeout_s: float, transport: RowTransport | None = None
) -> DedupEncoder:
    return DedupEncoder(
        _plan(world).for_rank(rank),
        transport or ProcessGroupTransport(),
        hidden=HIDDEN,
        handshake_timeout_s=timeout_s,
    )


def _rows(rank: int, keys: Sequence[UnitKey], weight: torch.Tensor) -> torch.Tensor:
    return weight.expand(sum(UNITS.index(k) + 2 for k in keys), HIDDEN) * (rank + 1)


def _outcome(call: Callable[[], object]) -> tuple[str, str, float]:
    """(error type, message, seconds) of ``call()``; ("", "", s) if it returned."""
    started = time.monotonic()
    try:
        call()
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - started
    return "", "", time.monotonic() - started


def _clean_round(rank: int) -> list[list[float]]:
    """A whole agreeing mini-batch: the features rank 0 and rank 1 encoded."""
    weight = torch.nn.Parameter(torch.ones(1, HIDDEN))
    dedup = _dedup(rank, 2, NEVER_S)
    dedup.encode(lambda keys: _rows(rank, keys, weight))
    features = dedup.features(0)
    features.sum().backward()
    dedup.backward()
    return features.tolist()


def _encoder_raises(rank: int, how: str) -> tuple[tuple[str, str, float], list[list[float]]]:
    """Rank 1's encoder fails (``how``); every rank's outcome, then a clean mini-batch."""
    weight = torch.nn.Parameter(torch.ones(1, HIDDEN))
    dedup = _dedup(rank, 2, NEVER_S)

    def encode(keys: Sequence[UnitKey]) -> torch.Tensor:
        if rank == 1 and how == "raises":
            raise OSError("rank 1 could not read image b")
        rows = _rows(rank, keys, weight)
        return rows[:-1] if rank == 1 and how == "short" else rows

    def step() -> None:
        dedup.encode(encode, keep_graph=not (rank == 1 and how == "forward_only"))
        dedup.features(0).sum().backward()
        dedup.backward()

    outcome = _outcome(step)
    return outcome, _clean_round(rank)


def test_encoder_failure_reaches_every_peer_at_once(world2: World) -> None:
    """encode_fn raising on one live rank: that rank raises its own error, its peer raises
    PeerFailed with that error at once (well within the bound), and the next mini-batch runs."""
    results = world2.run(_encoder_raises, "raises", timeout_s=OUTER_S)
    (kind0, message0, took0), (kind1, message1, took1) = (r[0] for r in results)
    assert kind1 == "OSError" and "could not read image b" in message1, message1
    assert kind0 == "PeerFailed", (kind0, message0)
    assert "rank 0, phase 'encode'" in message0, message0
    assert "rank 1 failed: OSError: rank 1 could not read image b" in message0, message0
    assert max(took0, took1) < NEVER_S / 2, (took0, took1)
    for _, features in results:  # the group is left usable
        assert features == [[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 3


def test_wrong_encoder_output_shape_reaches_every_peer(world2: World) -> None:
    """encode_fn returning too few rows on one rank: both ranks raise before rows move."""
    (kind0, message0, _), (kind1, message1, _) = (
        r[0] for r in world2.run(_encoder_raises, "short", timeout_s=OUTER_S)
    )
    assert kind1 == "ValueError" and "returned shape (2, 2); expected (3, 2)" in message1
    assert kind0 == "PeerFailed" and "rank 1 failed: ValueError" in message0, message0


def test_forward_only_on_one_rank_is_refused_at_encode(world2: World) -> None:
    """One rank encodes forward-only while its peer trains: both raise at encode, naming it
    (before, the forward-only rank raised alone at backward and its peer waited in the exchange)."""
    for kind, message, took in (
        r[0] for r in world2.run(_encoder_raises, "forward_only", timeout_s=OUTER_S)
    ):
        assert kind == "RouteMismatch", (kind, message)
        assert "phase 'encode'" in message and "keep_graph=False" in message, message
        assert took < NEVER_S / 2, took


class _StopsAfterHandshake(WatchedTransport):
    """Rank 2's transport: passes the handshake, then never joins the feature-row exchange."""

    __slots__ = ()

    def before(self, rows: bool) -> None:
        if rows:  # feature rows; handshake rows are int64
            raise RuntimeError("rank 2 stopped after the handshake")


def _peer_stops(rank: int, where: str, limit: float) -> tuple[str, str, float]:
    """Rank 2 never arrives at the handshake (``where="handshake"``) or stops after it."""
    weight = torch.nn.Parameter(torch.ones(1, HIDDEN))
    stops = rank == 2
    transport = _StopsAfterHandshake(ProcessGroupTransport()) if stops else None
    dedup = _dedup(rank, 3, limit, transport)
    if stops and where == "handshake":
        return "", "skipped", 0.0
    return _outcome(lambda: dedup.encode(lambda keys: _rows(rank, keys, weight)))


def test_peer_missing_at_the_handshake_is_named() -> None:
    """A rank that never reaches encode(): the others raise TimeoutError within the bound,
    naming the phase and that rank (not the ranks that did arrive)."""
    limit = 3.0  # the peer can never arrive, so a short bound cannot flake on a loaded machine
    for kind, message, took in run_world(_peer_stops, 3, "handshake", limit, timeout_s=OUTER_S)[:2]:
        assert kind == "TimeoutError", (kind, message)
        assert "rank(s) [2] did not reach 'encode' within 3 s" in message, message
        assert limit <= took < OUTER_S / 2, took


def test_row_exchange_after_the_handshake_is_bounded() -> None:
    """A rank that passes the handshake and then never sends its rows (alive, doing something
    else): the others raise TimeoutError within the bound, naming the phase and that rank."""
    limit = 5.0
    results = run_world(_peer_stops, 3, "exchange", limit, timeout_s=OUTER_S)
    assert "rank 2 stopped after the handshake" in results[2][1], results[2]
    for kind, message, took in results[:2]:
        assert kind == "TimeoutError", (kind, message)
        assert "rank 0" in message or "rank 1" in message, message
        assert "phase 'encode'" in message and "rank(s) [2]" in message, message
        assert "within 5 s" in message, message
        assert limit <= took < OUTER_S / 2, took
