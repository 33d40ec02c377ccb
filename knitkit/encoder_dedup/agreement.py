"""Before rows move, the ranks of a transport agree on the plan, the phase and every exchange's row counts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from knitkit.encoder_dedup.plan import RankRoute
from knitkit.encoder_dedup.transport import RowTransport, gather_rows

POINTS = ("encode", "backward", "step")
"""Agreement points (index = wire code): the two dedup phases, and a trainer's step start."""
VALUES = 10
"""Integers a rank can tell a peer at one agreement point (``agree`` uses 7, its ``extra`` the rest)."""
_TEXT_WORDS = 64
_FINGERPRINT_WORDS = 2
_NONE, _PHASE, _PLAN, _FORWARD, _BACKWARD, _GRAPH = range(6)
_DIRECTIONS = {_FORWARD: "forward", _BACKWARD: "backward"}
_MAX_LINES = 8
_TEXT_AT = 2 + VALUES
"""Column of an agreement row where ``_text_words`` starts (after point, turn, values)."""
_WIDTH = _TEXT_AT + 1 + _TEXT_WORDS
EXTRA_AT = _FINGERPRINT_WORDS + 5
"""Where ``agree``'s ``extra`` values start in an agreement row's values."""

# NOTE [ Handshake before rows move ]: a row exchange with counts that disagree between ranks
# keeps whatever the receive buffer held, and one that pairs a rank's backward with another rank's
# next encode silently mixes two mini-batches. So every exchange phase starts with tiny
# fixed-width exchanges that cannot themselves mismatch (every agreement row, at every point, has
# the same width and starts with its point and turn, so ranks at different points are told
# apart): (1) each rank sends every peer its phase, plan fingerprint, graph mode and the rows it
# will send to / expects from that peer, plus its own local failure if it has one (an encoder that
# raised, a wrong call order, an output of the wrong shape); (2) unless some rank failed, each rank
# tells every peer the first disagreement it found, so every rank raises the same full error, not
# only the two ranks involved. A local failure thus reaches every peer before any row moves: the
# peers raise ``PeerFailed`` naming the failing rank and its error, the failing rank raises its
# own. Waiting is bounded (``timeout_s``): a peer that never arrives (it skipped the phase, died, or
# is stuck outside knitkit) gives a TimeoutError naming the phase and the missing ranks instead of
# the process-group timeout. The same rows carry ``tell_all``, the one-round agreement trainers
# use before their own first collective (``integration/megatron/pipeline.py``); it all-gathers
# (one row per rank, the same for every peer), which scales to a whole world but cannot name a
# rank that never arrives.
#
# NOTE [ One round when the plan vouches ]: round (2) exists so that a disagreement only two
# ranks can see (the row counts between them) reaches every rank. Everything else a rank says
# in round (1) (its point and turn, plan fingerprint, graph mode, failure) it says alike to
# every peer, and each rank's n-th exchange hears every rank's n-th row, so every rank sees
# the same set of them. When that set shows one point, turn 1, one graph mode and one
# non-empty plan fingerprint, and no failure, every rank knows the others saw it too, and the
# counts need no report: they are a pure function of the fingerprinted plan
# (``build_routing_plan``), so each rank's own check of its counts against its peers' suffices.
# Every rank then skips round (2) together: one small exchange per phase instead of two
# (``benchmarks/grpo_step.py`` at de94463: each ``agree`` cost a rank ~0.9 ms of CPU and two
# waits for its slowest peer, six per GRPO step). Counts that differ under one fingerprint
# (routes built by different code from the same plan) are still caught: the two ranks
# involved raise ``RouteMismatch`` naming the counts at once, and the others, already past the
# handshake, fail in the row exchange, bounded, naming a peer that stopped after it. Any other
# disagreement (different fingerprints, a hand-built route without one, a phase or graph mode
# that differs) falls back to the two rounds on every rank, as before.


class RouteMismatch(RuntimeError):
    """Ranks of one transport disagree on the routing plan, the phase, or an exchange's row counts."""


class PeerFailed(RuntimeError):
    """A peer failed before rows moved (its error is in the message); raised on every other rank."""


@dataclass(frozen=True, slots=True)
class Heard:
    """What one rank told this one at an agreement point."""

    rank: int
    point: str
    """The point the rank was at (``"?"`` for a code this version does not know)."""
    turn: int
    """1 for a handshake's first exchange, 2 for its reports."""
    values: tuple[int, ...]
    problem: str
    """The rank's local failure, ``""`` if none (truncated to a few hundred bytes)."""

    @property
    def plan_word(self) -> int:
        """An ``agree`` row's first plan-fingerprint word (``fingerprint_words(...)[0]``)."""
        return self.values[0]

    @property
    def keep_graph(self) -> bool:
        """An ``agree`` row's graph mode."""
        return bool(self.values[_FINGERPRINT_WORDS])

    @property
    def extra(self) -> tuple[int, ...]:
        """An ``agree`` row's ``extra`` values (padded with zeros to ``VALUES``)."""
        return self.values[EXTRA_AT:]


def fingerprint_words(fingerprint: bytes) -> list[int]:
    """The plan fingerprint as signed 64-bit words (how it travels)."""
    padded = fingerprint.ljust(8 * _FINGERPRINT_WORDS, b"\0")[: 8 * _FINGERPRINT_WORDS]
    return [
        int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, len(padded), 8)
    ]


def tell_all(
    group: dist.ProcessGroup | None,
    point: str,
    values: Sequence[int],
    problem: str,
    *,
    device: torch.device,
    timeout_s: float,
    hint: str,
) -> list[Heard]:
    """Tell every rank of ``group`` ``values`` (at most ``VALUES`` ints) and ``problem``; hear theirs.

    One bounded all-gather (``gather_rows``); every rank gets the same list, in rank order, so
    every rank can reach the same verdict. ``hint`` ends the TimeoutError raised when a rank
    does not arrive.
    """
    row = _wire(point, 1, [values], problem, device)
    with _named(dist.get_rank(group), point, timeout_s, hint):
        received = gather_rows(row, group, timeout_s=timeout_s)
    return _heard_all(received)


def _exchange_rows(
    transport: RowTransport,
    point: str,
    rows: Sequence[Sequence[int]],
    problem: str,
    *,
    device: torch.device,
    timeout_s: float,
    hint: str,
    turn: int = 1,
) -> list[Heard]:
    """Send peer ``p`` the agreement row ``rows[p]`` with this rank's ``problem``; bounded by ``timeout_s``."""
    send = _wire(point, turn, rows, problem, device)
    ones = [1] * transport.world_size
    with _named(transport.rank, point, timeout_s, hint):
        received = transport.exchange(send, ones, ones, timeout_s=timeout_s)
    return _heard_all(received)


@contextlib.contextmanager
def _named(me: int, point: str, timeout_s: float, hint: str) -> Iterator[None]:
    """Errors of an agreement exchange, naming this rank, the point and (where known) the late ranks."""
    try:
        yield
    except TimeoutError as error:
        late = tuple(getattr(error, "peers", ()))
        who = "a rank" if not late else f"rank(s) {list(late)}"
        if late and not getattr(error, "exact", True):
            who = f"one of rank(s) {list(late)}"
        raise TimeoutError(
            f"rank {me}: {who} did not reach {point!r} within {timeout_s:g} s; {hint}"
        ) from error
    except RuntimeError as error:  # a dropped link: the backend names no phase
        raise RuntimeError(f"rank {me}, at {point!r}: {error}") from error


Verdict = Callable[[list["Heard"]], None]
"""Judges every rank's agreement row first, before ``agree``'s own checks (it raises to refuse)."""


def agree(
    route: RankRoute | None,
    transport: RowTransport,
    phase: str,
    *,
    device: torch.device,
    timeout_s: float,
    problem: str = "",
    keep_graph: bool = True,
    extra: Sequence[int] = (),
    verdict: Verdict | None = None,
) -> None:
    """Raise on every rank unless all ranks are in ``phase`` with matching routes and none failed.

    ``problem`` is this rank's local failure (its error, as text): peers raise ``PeerFailed``
    naming it, this rank returns (its caller raises its own error). Disagreements raise
    ``RouteMismatch`` on every rank. See NOTE [ Handshake before rows move ].

    ``extra`` (at most ``VALUES - 7`` ints, from ``Heard.values[EXTRA_AT]`` on) rides along to
    every peer and ``verdict`` judges every rank's row before anything else here, so a caller
    can fold its own agreement into this one (NOTE [ One handshake per step ] in
    ``integration/megatron/step.py``). ``route=None``: a rank that has no usable route (it
    refused the step) tells its ``problem`` with zero counts; it needs a ``problem``.
    """
    size, me = transport.world_size, transport.rank
    if route is None and not problem:
        raise ValueError("agree(route=None) is for a rank that failed: pass its problem")
    mine = [
        *fingerprint_words(route.plan_fingerprint if route is not None else b""),
        int(keep_graph),
    ]
    if route is None:
        rows = [[*mine, 0, 0, 0, 0, *extra] for _ in range(size)]
    else:
        fwd, bwd = route.forward, route.backward
        rows = [
            [
                *mine,
                *(fwd.send_counts[p], fwd.recv_counts[p], bwd.send_counts[p], bwd.recv_counts[p]),
                *extra,
            ]
            for p in range(size)
        ]
    hint = (
        f"a rank skipped DedupEncoder.{phase}() (every rank of the transport must call "
        "encode() then backward() each mini-batch), died, or is stuck outside knitkit"
    )
    heard = _exchange_rows(
        transport, phase, rows, problem, device=device, timeout_s=timeout_s, hint=hint
    )
    if verdict is not None:
        verdict(heard)
    failed = [h for h in heard if h.problem and h.rank != me]
    if failed:
        raise PeerFailed(_failures(me, phase, failed))
    if any(h.problem for h in heard):
        return  # this rank failed alone; every rank saw it, so none runs round 2
    assert route is not None  # a rank without one has a problem
    report = [_NONE, 0, 0, 0]
    for row in heard:
        report = _first_problem(row, phase, mine, route)
        if report[0] != _NONE:
            break
    if route.plan_fingerprint and all(
        h.point == phase and h.turn == 1 and list(h.values[: _FINGERPRINT_WORDS + 1]) == mine
        for h in heard
    ):  # see NOTE [ One round when the plan vouches ]
        if report[0] == _NONE:
            return
        raise RouteMismatch(
            f"rank {me}, phase {phase!r}: routes of the same plan (one fingerprint on every "
            f"rank) disagree before any row moved: {_describe(me, report)} The ranks built "
            "their routes with different code; run one knitkit version on every rank."
        )
    reports = _exchange_rows(
        transport,
        phase,
        [report] * size,
        "",
        device=device,
        timeout_s=timeout_s,
        hint=hint,
        turn=2,
    )
    found = [_describe(h.rank, list(h.values[:4])) for h in reports if h.values[0] != _NONE]
    lines = list(dict.fromkeys(found))[:_MAX_LINES]  # both ends of a pair report the same
    if len(set(found)) > _MAX_LINES:
        lines.append(f"({len(set(found)) - _MAX_LINES} more disagreements.)")
    if lines:
        groups: dict[tuple[int, ...], list[int]] = {}
        for h in heard:
            groups.setdefault(h.values[:_FINGERPRINT_WORDS], []).append(h.rank)
        plans = "; ".join(f"ranks {ranks}" for ranks in groups.values())
        raise RouteMismatch(
            f"rank {me}, phase {phase!r}: the ranks of the encoder transport disagree before any "
            f"row moved ({'routing plans differ: ' + plans if len(groups) > 1 else 'same plan'}). "
            + " ".join(lines)
            + " Build every rank's route from the same plan (same metadata, same topology) and "
            "call encode() then backward() on every rank each mini-batch."
        )


def _failures(me: int, phase: str, failed: list[Heard]) -> str:
    lines = [f"rank {h.rank} failed: {h.problem}" for h in failed[:_MAX_LINES]]
    if len(failed) > _MAX_LINES:
        lines.append(f"({len(failed) - _MAX_LINES} more failed ranks)")
    return (
        f"rank {me}, phase {phase!r}: a peer failed before any row moved, so every rank of the "
        "encoder transport stops here (the failing rank raises its own error). " + "; ".join(lines)
    )


def _first_problem(heard: Heard, phase: str, mine: list[int], route: RankRoute) -> list[int]:
    """``[kind, peer, mine, theirs]`` of the first disagreement with a peer: phase, counts, graph, plan."""
    peer = heard.rank
    if heard.point != phase or heard.turn != 1:
        theirs = POINTS.index(heard.point) if heard.point in POINTS else -1
        return [_PHASE, peer, POINTS.index(phase), theirs]
    values = heard.values
    counts = values[_FINGERPRINT_WORDS + 1 : _FINGERPRINT_WORDS + 5]
    for kind, step, (sends, expects) in (
        (_FORWARD, route.forward, counts[0:2]),
        (_BACKWARD, route.backward, counts[2:4]),
    ):
        if sends != step.recv_counts[peer]:  # peer -> me; negative "mine" marks this direction
            return [kind, peer, -1 - step.recv_counts[peer], sends]
        if expects != step.send_counts[peer]:  # me -> peer
            return [kind, peer, step.send_counts[peer], expects]
    if values[_FINGERPRINT_WORDS] != mine[_FINGERPRINT_WORDS]:
        return [_GRAPH, peer, mine[_FINGERPRINT_WORDS], values[_FINGERPRINT_WORDS]]
    if list(values[:_FINGERPRINT_WORDS]) != mine[:_FINGERPRINT_WORDS]:
        return [_PLAN, peer, 0, 0]
    return [_NONE, 0, 0, 0]


def _describe(rank: int, report: list[int]) -> str:
    kind, peer, mine, theirs = report
    if kind in (_PHASE, _GRAPH):  # ordered by rank, so both ends of the pair describe it alike
        (a, state_a), (b, state_b) = sorted([(rank, mine), (peer, theirs)])
        if kind == _GRAPH:
            return (
                f"rank {a} encodes with keep_graph={bool(state_a)} while rank {b} has "
                f"keep_graph={bool(state_b)} (a forward-only pass on some ranks only)."
            )
        return (
            f"rank {a} is in phase {_point(state_a)!r} while rank {b} is in phase "
            f"{_point(state_b)!r} (one of them skipped a phase)."
        )
    if kind == _PLAN:
        low, high = sorted((rank, peer))
        return f"ranks {low} and {high} have different plan fingerprints."
    direction = _DIRECTIONS[kind]
    if mine < 0:  # the peer sends to this rank
        return (
            f"rank {peer} sends {theirs} {direction} rows to rank {rank}, "
            f"which expects {-1 - mine}."
        )
    return f"rank {rank} sends {mine} {direction} rows to rank {peer}, which expects {theirs}."


def _point(code: int) -> str:
    return POINTS[code] if 0 <= code < len(POINTS) else "?"


def _wire(
    point: str, turn: int, rows: Sequence[Sequence[int]], problem: str, device: torch.device
) -> torch.Tensor:
    """Agreement rows, one per entry of ``rows`` (see NOTE [ Handshake before rows move ]):
    point, turn, the row's values, and ``problem`` as ``_text_words`` (one array, filled by row
    in numpy, one tensor: ``torch.tensor`` of nested lists costs ~50 us a handshake; the text
    is encoded only when there is one)."""
    widest = max((len(values) for values in rows), default=0)
    if widest > VALUES:
        raise ValueError(f"an agreement row holds at most {VALUES} values, got {widest}")
    wire = np.zeros((len(rows), _WIDTH), dtype=np.int64)
    wire[:, 0], wire[:, 1] = POINTS.index(point), turn
    for line, values in zip(wire, rows, strict=True):
        line[2 : 2 + len(values)] = values
    if problem:
        wire[:, _TEXT_AT:] = _text_words(problem)
    return torch.from_numpy(wire).to(device)


def _text_words(text: str) -> list[int]:
    """``[byte length, words...]``: UTF-8 text in fixed-width int64 words (cut with '...' if long)."""
    data = text.encode()
    room = 8 * _TEXT_WORDS
    if len(data) > room:
        data = data[: room - 3] + b"..."
    padded = data.ljust(room, b"\0")
    words = [int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, room, 8)]
    return [len(data), *words]


def _heard_all(received: torch.Tensor) -> list[Heard]:
    """Every rank's agreement row, decoded (the text words only of rows that carry a problem)."""
    received = received.cpu()
    heard = []
    for rank, (point, turn, *rest) in enumerate(received[:, : _TEXT_AT + 1].tolist()):
        values, length = rest[:VALUES], rest[VALUES]
        problem = ""
        if length > 0:
            words = received[rank, _TEXT_AT + 1 :].tolist()
            data = b"".join(w.to_bytes(8, "little", signed=True) for w in words)
            problem = data[: min(length, len(data))].decode(errors="replace")
        heard.append(Heard(rank, _point(point), turn, tuple(values), problem))
    return heard
