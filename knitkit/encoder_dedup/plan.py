"""Routing plan: which encoding rows move from each encoding rank to each consumer, and which gradients return."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from knitkit.encoder_dedup.assignment import BackboneAssignment, EncoderAssignment, RowSlice
from knitkit.types import UnitKey


@dataclass(frozen=True, slots=True)
class Exchange:
    """One all-to-all step of a rank: rows it sends (gathered by index) and rows it receives (placed by index)."""

    send_counts: tuple[int, ...]
    """Rows sent to each peer, in peer order."""
    send_index: torch.Tensor
    """Source row of every sent row, grouped by peer."""
    recv_counts: tuple[int, ...]
    recv_index: torch.Tensor
    """Destination row of every received row, grouped by peer."""


@dataclass(frozen=True, slots=True)
class RankRoute:
    """Everything one rank needs for a mini-batch: its encoder work, its cache layout and its two exchanges."""

    rank: int
    encoder_micro_batches: tuple[tuple[UnitKey, ...], ...]
    encoder_rows: tuple[int, ...]
    """Output rows of each encoder micro-batch (its units' rows, concatenated in order)."""
    cache_rows: int
    """Rows of the local cache: the union of everything this rank's backbone micro-batches consume."""
    micro_batch_index: tuple[torch.Tensor, ...]
    """Cache rows gathered, in feature order, for each backbone micro-batch."""
    forward: Exchange
    """Encoding table rows -> cache rows (detached values)."""
    backward: Exchange
    """Owned cache-gradient rows -> encoding table rows (summed with ``index_add_``)."""
    plan_fingerprint: bytes = b""
    """Digest of the whole plan's inputs; ranks compare it before rows move (``agreement.py``)."""

    @property
    def table_rows(self) -> int:
        return sum(self.encoder_rows)


@dataclass(frozen=True, slots=True)
class RoutingPlan:
    """The routes of every rank of one mini-batch; identical on all ranks, built from metadata only."""

    routes: tuple[RankRoute, ...]

    def for_rank(self, rank: int) -> RankRoute:
        return self.routes[rank]


Segment = tuple[UnitKey, int, int, int]
"""(key, first row, end row, first cache row) of one contiguous run of a consumer's cache."""
Run = tuple[int, int]
"""(first row, number of rows) of a contiguous run of rows."""


def build_routing_plan(
    encoder: EncoderAssignment, backbone: BackboneAssignment, world_size: int
) -> RoutingPlan:
    """Route every consumed row from its encoding rank and every owned gradient row back (pure)."""
    routing = _Routing.of(encoder, backbone, world_size, None)
    return RoutingPlan(tuple(routing.route(rank) for rank in range(world_size)))


def build_rank_route(
    encoder: EncoderAssignment, backbone: BackboneAssignment, world_size: int, rank: int
) -> RankRoute:
    """``build_routing_plan(...).for_rank(rank)`` without the other ranks' row indices (pure;
    the same checks, the same route: what a rank builds for itself each mini-batch)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside the world of {world_size} ranks")
    return _Routing.of(encoder, backbone, world_size, rank).route(rank)


# NOTE [ One rank's route ]: a rank builds its own route each mini-batch, on its pass-end
# thread (``knitkit/job/rank.py``). Its exchanges pair it with every peer, so it still lays out
# every consumer's cache (the rows it sends a consumer land at that consumer's cache offsets),
# but TP replicas consume identical micro-batches (checked), so each TP group's cache is laid
# out once and shared by its members, and only the runs this rank sends or receives are kept.
# The plan fingerprint is a digest of one string of names and integers, not of dataclass
# ``repr``s (which walked every key and slice through the recursive-repr guard: ~40% of a
# route's CPU). ``build_routing_plan`` builds every pair, for every rank.


@dataclass(frozen=True, slots=True)
class _Routing:
    """What every rank's route is cut from: the plan's runs per (sender, receiver) pair."""

    encoder: EncoderAssignment
    backbone: BackboneAssignment
    world_size: int
    encoder_rows: dict[int, tuple[int, ...]]
    segments: dict[int, list[Segment]]
    forward: dict[tuple[int, int], tuple[list[Run], list[Run]]]
    backward: dict[tuple[int, int], tuple[list[Run], list[Run]]]
    fingerprint: bytes

    @classmethod
    def of(
        cls,
        encoder: EncoderAssignment,
        backbone: BackboneAssignment,
        world_size: int,
        rank: int | None,
    ) -> _Routing:
        """The runs of every (sender, receiver) pair, or only ``rank``'s (NOTE [ One rank's route ])."""
        _check_backbone(backbone, world_size)
        owner, table_offset, encoder_rows = _encoder_layout(encoder, world_size)
        encoded_rows = {key: encoder.num_rows[key] for key in owner}
        segments = _group_segments(backbone, encoded_rows)
        owned = _tp_owned(backbone, segments)
        fwd: dict[tuple[int, int], tuple[list[Run], list[Run]]] = defaultdict(lambda: ([], []))
        bwd: dict[tuple[int, int], tuple[list[Run], list[Run]]] = defaultdict(lambda: ([], []))
        for consumer, segs in segments.items():
            every = rank is None or consumer == rank
            for key, start, stop, cache_at in segs:
                if every or owner[key] == rank:
                    src, dst = fwd[(owner[key], consumer)]
                    src.append((table_offset[key] + start, stop - start))
                    dst.append((cache_at, stop - start))
            for key, start, stop, cache_at in owned[consumer]:
                if every or owner[key] == rank:
                    src, dst = bwd[(consumer, owner[key])]
                    src.append((cache_at, stop - start))
                    dst.append((table_offset[key] + start, stop - start))
        fingerprint = plan_fingerprint(encoder, backbone, world_size)
        return cls(encoder, backbone, world_size, encoder_rows, segments, fwd, bwd, fingerprint)

    def route(self, rank: int) -> RankRoute:
        """One rank's route: its encoder work, cache layout, row indices and exchanges."""
        segs = self.segments.get(rank, [])
        return RankRoute(
            rank=rank,
            encoder_micro_batches=tuple(
                tuple(mb) for mb in self.encoder.micro_batches.get(rank, ())
            ),
            encoder_rows=self.encoder_rows[rank],
            cache_rows=sum(stop - start for _, start, stop, _ in segs),
            micro_batch_index=_gather_indices(self.backbone.micro_batches.get(rank, ()), segs),
            forward=_exchange(rank, self.world_size, self.forward),
            backward=_exchange(rank, self.world_size, self.backward),
            plan_fingerprint=self.fingerprint,
        )


def plan_fingerprint(
    encoder: EncoderAssignment, backbone: BackboneAssignment, world_size: int
) -> bytes:
    """A 16-byte digest of everything a routing plan is built from (equal inputs, equal digest;
    NOTE [ One rank's route ])."""
    parts = [f"world {world_size}"]
    for rank in sorted(encoder.micro_batches):
        parts.append(f"encoder {rank}")
        for micro_batch in encoder.micro_batches[rank]:
            parts.append("|")
            parts += [f"{key.owner}/{key.field}" for key in micro_batch]
    parts.append("rows")
    parts += sorted(f"{key.owner}/{key.field}={n}" for key, n in encoder.num_rows.items())
    texts: dict[int, str] = {}  # TP replicas handed one object are spelled once
    for rank in sorted(backbone.micro_batches):
        micro_batches = backbone.micro_batches[rank]
        text = texts.get(id(micro_batches))
        if text is None:
            text = texts[id(micro_batches)] = "|".join(
                ",".join(f"{s.key.owner}/{s.key.field}[{s.start}:{s.stop}]" for s in micro_batch)
                for micro_batch in micro_batches
            )
        parts.append(f"backbone {rank}:{text}")
    parts += [f"tp {list(group)}" for group in backbone.tp_groups]
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).digest()


def _group_segments(
    backbone: BackboneAssignment, num_rows: Mapping[UnitKey, int]
) -> dict[int, list[Segment]]:
    """Every consumer's cache segments, laid out once per micro-batch list (TP replicas handed
    one object share it; ``_tp_owned`` checks that replicas consume the same slices)."""
    laid_out: dict[int, list[Segment]] = {}
    segments = {}
    for rank, micro_batches in backbone.micro_batches.items():
        segs = laid_out.get(id(micro_batches))
        if segs is None:
            segs = laid_out[id(micro_batches)] = _cache_segments(rank, micro_batches, num_rows)
        segments[rank] = segs
    return segments


def _check_backbone(backbone: BackboneAssignment, world_size: int) -> None:
    """Every consumer and TP member is a rank of the world; no rank is in two TP groups."""
    for rank in backbone.micro_batches:
        if not 0 <= rank < world_size:
            raise ValueError(
                f"consumer rank {rank} outside the world of {world_size} ranks; plan ranks are "
                "ranks of the transport's group (pass group ranks, not global ranks, for a subgroup)"
            )
    group_of: dict[int, tuple[int, ...]] = {}
    for group in backbone.tp_groups:
        members = tuple(group)
        for member in members:
            if not 0 <= member < world_size:
                raise ValueError(
                    f"TP group {members} names rank {member}, outside the world of {world_size} ranks"
                )
            if member in group_of:
                raise ValueError(
                    f"rank {member} is in TP groups {group_of[member]} and {members}; "
                    "each rank belongs to exactly one TP group"
                )
            group_of[member] = members


def _encoder_layout(
    encoder: EncoderAssignment, world_size: int
) -> tuple[dict[UnitKey, int], dict[UnitKey, int], dict[int, tuple[int, ...]]]:
    owner: dict[UnitKey, int] = {}
    offset: dict[UnitKey, int] = {}
    rows: dict[int, tuple[int, ...]] = {r: () for r in range(world_size)}
    for rank, micro_batches in encoder.micro_batches.items():
        if not 0 <= rank < world_size:
            raise ValueError(f"encoder rank {rank} outside the world of {world_size} ranks")
        at, per_mb = 0, []
        for micro_batch in micro_batches:
            start = at
            for key in micro_batch:
                if key in owner:
                    raise ValueError(
                        f"unit {key} is encoded by ranks {owner[key]} and {rank}; "
                        "assign each unique unit to exactly one encoding rank"
                    )
                if key not in encoder.num_rows:
                    raise ValueError(f"unit {key} has no entry in EncoderAssignment.num_rows")
                owner[key], offset[key] = rank, at
                at += encoder.num_rows[key]
            per_mb.append(at - start)
        rows[rank] = tuple(per_mb)
    return owner, offset, rows


def _cache_segments(
    rank: int, micro_batches: Sequence[Sequence[RowSlice]], num_rows: Mapping[UnitKey, int]
) -> list[Segment]:
    """Merge every slice a rank consumes into disjoint runs, laid out in (key, row) order."""
    wanted: dict[UnitKey, list[tuple[int, int]]] = defaultdict(list)
    for micro_batch in micro_batches:
        for piece in micro_batch:
            if piece.key not in num_rows:
                raise ValueError(
                    f"rank {rank} consumes unit {piece.key}, which no encoder rank encodes; "
                    "add it to the EncoderAssignment"
                )
            if not 0 <= piece.start < piece.stop <= num_rows[piece.key]:
                raise ValueError(
                    f"rank {rank} consumes rows [{piece.start}, {piece.stop}) of unit {piece.key}, "
                    f"which has {num_rows[piece.key]} rows"
                )
            wanted[piece.key].append((piece.start, piece.stop))
    segments: list[Segment] = []
    at = 0
    for key in sorted(wanted):
        runs: list[list[int]] = []
        for start, stop in sorted(wanted[key]):
            if runs and start <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], stop)
            else:
                runs.append([start, stop])
        for start, stop in runs:
            segments.append((key, start, stop, at))
            at += stop - start
    return segments


def _tp_owned(
    backbone: BackboneAssignment, segments: Mapping[int, list[Segment]]
) -> dict[int, list[Segment]]:
    """Split each TP group's (identical) cache into contiguous, near-equal owned parts, one per member.

    Every TP rank of a group holds the full, identical gradient of a replicated input, so each
    returns only its owned part: together they return every row exactly once.
    """
    owned = {rank: list(segs) for rank, segs in segments.items()}
    for group in backbone.tp_groups:
        members = list(group)
        first = members[0]
        for member in members[1:]:
            if backbone.micro_batches.get(member) != backbone.micro_batches.get(first):
                raise ValueError(
                    f"TP ranks {first} and {member} consume different micro-batches; "
                    "TP replicas must see identical inputs (fix the backbone assignment or tp_groups)"
                )
        total = sum(stop - start for _, start, stop, _ in segments.get(first, []))
        for i, member in enumerate(members):
            lo, hi = total * i // len(members), total * (i + 1) // len(members)
            owned[member] = _cut(segments.get(first, []), lo, hi)
    return owned


def _cut(segments: list[Segment], lo: int, hi: int) -> list[Segment]:
    """The parts of ``segments`` that cover cache rows ``[lo, hi)``."""
    out: list[Segment] = []
    for key, start, stop, at in segments:
        a, b = max(lo, at), min(hi, at + stop - start)
        if a < b:
            out.append((key, start + a - at, start + b - at, a))
    return out


def _gather_indices(
    micro_batches: Sequence[Sequence[RowSlice]], segments: list[Segment]
) -> tuple[torch.Tensor, ...]:
    """Cache rows of every backbone micro-batch, in feature order."""
    runs: dict[UnitKey, list[Segment]] = defaultdict(list)
    for segment in segments:
        runs[segment[0]].append(segment)
    indices = []
    for micro_batch in micro_batches:
        rows: list[Run] = []
        for piece in micro_batch:
            # A consumed slice lies inside exactly one merged run of its unit.
            _, start, _, at = next(
                s for s in runs[piece.key] if s[1] <= piece.start and piece.stop <= s[2]
            )
            rows.append((at + piece.start - start, piece.stop - piece.start))
        indices.append(_index(rows))
    return tuple(indices)


def _exchange(
    rank: int, world_size: int, pairs: Mapping[tuple[int, int], tuple[list[Run], list[Run]]]
) -> Exchange:
    send = [pairs.get((rank, peer), ([], []))[0] for peer in range(world_size)]
    recv = [pairs.get((peer, rank), ([], []))[1] for peer in range(world_size)]
    return Exchange(
        send_counts=tuple(sum(n for _, n in runs) for runs in send),
        send_index=_index([run for runs in send for run in runs]),
        recv_counts=tuple(sum(n for _, n in runs) for runs in recv),
        recv_index=_index([run for runs in recv for run in runs]),
    )


def _index(runs: Sequence[Run]) -> torch.Tensor:
    """Concatenated row indices of ``runs``, in numpy (no Python int per row, no torch op on a
    few elements, nor torch's intra-op pool: NOTE [ Segment ids off the intra-op pool ] in
    segments.py)."""
    if not runs:
        return torch.empty(0, dtype=torch.int64)
    firsts, lengths = np.array(runs, dtype=np.int64).T
    shift = firsts - (np.cumsum(lengths) - lengths)
    return torch.from_numpy(
        np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(shift, lengths)
    )
