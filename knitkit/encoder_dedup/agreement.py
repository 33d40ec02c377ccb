"""Before rows move, the ranks of a transport agree on the plan, the phase and every exchange's row counts."""

from __future__ import annotations

import torch

from knitkit.encoder_dedup.plan import RankRoute
from knitkit.encoder_dedup.transport import RowTransport

PHASES = ("encode", "backward")
"""The two phases whose exchanges a handshake guards (index = wire code)."""
_FINGERPRINT_WORDS = 2
_NONE, _PHASE, _PLAN, _FORWARD, _BACKWARD = range(5)
_DIRECTIONS = {_FORWARD: "forward", _BACKWARD: "backward"}
_MAX_LINES = 8

# NOTE [ Handshake before rows move ]: an all-to-all with row counts that disagree between ranks
# is not detected by the backends (gloo accepts a short message; the missing rows keep whatever
# the receive buffer held) and an all-to-all that pairs one rank's backward with another rank's
# next encode silently mixes two mini-batches. So every exchange phase starts with two tiny
# fixed-size all-to-alls that cannot themselves mismatch: (1) each rank sends every peer its
# phase, its plan fingerprint and the rows it will send to / expects from that peer; each rank
# checks what concerns it; (2) each rank tells every peer the first disagreement it found, so
# every rank raises the same full error, not only the two ranks involved. Waiting is bounded
# (``timeout_s``): a peer that never arrives (it skipped the phase or died) gives a TimeoutError
# naming the phase instead of the process-group timeout.


class RouteMismatch(RuntimeError):
    """Ranks of one transport disagree on the routing plan, the phase, or an exchange's row counts."""


def fingerprint_words(fingerprint: bytes) -> list[int]:
    """The plan fingerprint as signed 64-bit words (how it travels)."""
    padded = fingerprint.ljust(8 * _FINGERPRINT_WORDS, b"\0")[: 8 * _FINGERPRINT_WORDS]
    return [
        int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, len(padded), 8)
    ]


def agree(
    route: RankRoute,
    transport: RowTransport,
    phase: str,
    *,
    device: torch.device,
    timeout_s: float,
) -> None:
    """Raise ``RouteMismatch`` on every rank unless all ranks are in ``phase`` with matching routes."""
    size, me, code = transport.world_size, transport.rank, PHASES.index(phase)
    fwd, bwd = route.forward, route.backward
    words = fingerprint_words(route.plan_fingerprint)
    rows = [
        [
            code,
            *words,
            fwd.send_counts[p],
            fwd.recv_counts[p],
            bwd.send_counts[p],
            bwd.recv_counts[p],
        ]
        for p in range(size)
    ]
    heard = _exchange(transport, rows, device, phase, timeout_s)
    mine = rows[0][: 1 + _FINGERPRINT_WORDS]
    problem = [_NONE, 0, 0, 0]
    for peer, row in enumerate(heard):
        problem = _first_problem(peer, row, code, mine[1:], route)
        if problem[0] != _NONE:
            break
    reports = _exchange(transport, [problem] * size, device, phase, timeout_s)
    fingerprints = [tuple(row[1 : 1 + _FINGERPRINT_WORDS]) for row in heard]
    found = [_describe(rank, report) for rank, report in enumerate(reports) if report[0] != _NONE]
    lines = list(dict.fromkeys(found))[:_MAX_LINES]  # both ends of a pair report the same
    if len(set(found)) > _MAX_LINES:
        lines.append(f"({len(set(found)) - _MAX_LINES} more disagreements.)")
    if lines:
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, digest in enumerate(fingerprints):
            groups.setdefault(digest, []).append(rank)
        plans = "; ".join(f"ranks {ranks}" for ranks in groups.values())
        raise RouteMismatch(
            f"rank {me}, phase {phase!r}: the ranks of the encoder transport disagree before any "
            f"row moved ({'routing plans differ: ' + plans if len(groups) > 1 else 'same plan'}). "
            + " ".join(lines)
            + " Build every rank's route from the same plan (same metadata, same topology) and "
            "call encode() then backward() on every rank each mini-batch."
        )


def _first_problem(
    peer: int, row: list[int], code: int, fingerprint: list[int], route: RankRoute
) -> list[int]:
    """``[kind, peer, mine, theirs]`` of the first disagreement with ``peer``: phase, counts, plan."""
    if row[0] != code:
        return [_PHASE, peer, code, row[0]]
    counts = row[1 + _FINGERPRINT_WORDS :]
    for kind, step, (sends, expects) in (
        (_FORWARD, route.forward, counts[0:2]),
        (_BACKWARD, route.backward, counts[2:4]),
    ):
        if sends != step.recv_counts[peer]:  # peer -> me; negative "mine" marks this direction
            return [kind, peer, -1 - step.recv_counts[peer], sends]
        if expects != step.send_counts[peer]:  # me -> peer
            return [kind, peer, step.send_counts[peer], expects]
    if row[1 : 1 + _FINGERPRINT_WORDS] != fingerprint:
        return [_PLAN, peer, 0, 0]
    return [_NONE, 0, 0, 0]


def _describe(rank: int, report: list[int]) -> str:
    kind, peer, mine, theirs = report
    if kind == _PHASE:  # ordered by rank, so both ends of the pair describe it alike
        (a, phase_a), (b, phase_b) = sorted([(rank, PHASES[mine]), (peer, PHASES[theirs])])
        return (
            f"rank {a} is in phase {phase_a!r} while rank {b} is in phase {phase_b!r} "
            "(one of them skipped a phase)."
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


def _exchange(
    transport: RowTransport,
    rows: list[list[int]],
    device: torch.device,
    phase: str,
    timeout_s: float,
) -> list[list[int]]:
    send = torch.tensor(rows, dtype=torch.int64, device=device)
    ones = [1] * transport.world_size
    try:
        received = transport.exchange(send, ones, ones, timeout_s=timeout_s)
    except TimeoutError as error:
        raise TimeoutError(
            f"rank {transport.rank}: peers did not reach phase {phase!r} within {timeout_s:g} s; "
            f"a rank skipped DedupEncoder.{phase}() (every rank of the transport must call "
            "encode() then backward() each mini-batch) or died"
        ) from error
    return [[int(x) for x in row] for row in received.cpu().tolist()]
