"""From a storage mini-batch plan's values to the dedup routing plan, written once for every trainer.

The bridge reads plan values through the Protocols below (``knitkit.storage``'s ``ConsumerPlan``,
``MicroBatchPlan``, ``SequenceSlice`` and ``EncoderRankPlan`` satisfy them), so encoder_dedup
never imports storage.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Protocol

from knitkit.encoder_dedup.assignment import (
    BackboneAssignment,
    EncoderAssignment,
    RowSlice,
    row_slices,
)
from knitkit.encoder_dedup.plan import (
    RankRoute,
    RoutingPlan,
    build_rank_route,
    build_routing_plan,
)
from knitkit.types import MultimodalRef, SeqRange, UnitKey


class SequenceValues(Protocol):
    """One trajectory's share of a packed micro-batch (a ``SequenceSlice``)."""

    @property
    def multimodal(self) -> Sequence[MultimodalRef]: ...

    @property
    def chunks(self) -> Sequence[SeqRange]: ...


class MicroBatchValues(Protocol):
    """One backbone micro-batch: its sequences in packing order (a ``MicroBatchPlan``)."""

    @property
    def sequences(self) -> Sequence[SequenceValues]: ...


class ConsumerValues(Protocol):
    """One backbone (DP, CP) consumer's micro-batches (a ``ConsumerPlan``)."""

    @property
    def dp_rank(self) -> int: ...

    @property
    def cp_rank(self) -> int: ...

    @property
    def micro_batches(self) -> Sequence[MicroBatchValues]: ...


class EncoderRankValues(Protocol):
    """One encoder DP rank's micro-batches of unique units (an ``EncoderRankPlan``)."""

    @property
    def dp_rank(self) -> int: ...

    @property
    def micro_batches(self) -> Sequence[Sequence[UnitKey]]: ...


def feature_slices(micro_batch: MicroBatchValues) -> tuple[RowSlice, ...]:
    """Encoding rows a packed micro-batch consumes, in the order its placeholder tokens appear."""
    return tuple(
        piece for seq in micro_batch.sequences for piece in row_slices(seq.multimodal, seq.chunks)
    )


def route_minibatch(
    backbone: Mapping[int, ConsumerValues],
    encoder: Sequence[EncoderRankValues],
    *,
    world_size: int,
    encoder_ranks: Sequence[int] | None = None,
) -> RoutingPlan:
    """The dedup routing plan of one mini-batch, from its storage plan (pure, same on every rank).

    ``backbone`` maps every route rank to the consumer plan it trains on; route ranks given the
    same (DP, CP) consumer are its TP replicas. ``encoder`` holds every encoder DP rank's plan;
    encoder DP rank ``e`` encodes on route rank ``encoder_ranks[e]`` (default: ``e``). Empty
    encoder micro-batches are dropped: a rank with nothing to encode gets no micro-batch at all.
    """
    encoders, assignment = _assignments(backbone, encoder, world_size, encoder_ranks)
    return build_routing_plan(encoders, assignment, world_size)


def route_rank(
    backbone: Mapping[int, ConsumerValues],
    encoder: Sequence[EncoderRankValues],
    *,
    world_size: int,
    rank: int,
    encoder_ranks: Sequence[int] | None = None,
) -> RankRoute:
    """``route_minibatch(...).for_rank(rank)``, without building the other ranks' row indices
    (``build_rank_route``): what a rank computes for itself each mini-batch."""
    encoders, assignment = _assignments(backbone, encoder, world_size, encoder_ranks)
    return build_rank_route(encoders, assignment, world_size, rank)


def _assignments(
    backbone: Mapping[int, ConsumerValues],
    encoder: Sequence[EncoderRankValues],
    world_size: int,
    encoder_ranks: Sequence[int] | None,
) -> tuple[EncoderAssignment, BackboneAssignment]:
    """The encoder and backbone assignments of a mini-batch's storage plan (``route_minibatch``)."""
    placed = list(range(len(encoder))) if encoder_ranks is None else list(encoder_ranks)
    if len(placed) != len(encoder) or any(not 0 <= r < world_size for r in placed):
        raise ValueError(
            f"encoder_ranks={placed} must place each of the {len(encoder)} encoder DP ranks on a "
            f"route rank in [0, {world_size}); pass one route rank per encoder rank"
        )
    micro_batches: dict[int, list[tuple[RowSlice, ...]]] = {}
    replicas: dict[tuple[int, int], list[int]] = defaultdict(list)
    num_rows: dict[UnitKey, int] = {}
    for rank, consumer in backbone.items():
        group = replicas[(consumer.dp_rank, consumer.cp_rank)]
        group.append(rank)
        if len(group) > 1:  # a TP replica: its group's one list (NOTE [ One rank's route ])
            micro_batches[rank] = micro_batches[group[0]]
            continue
        micro_batches[rank] = [feature_slices(mb) for mb in consumer.micro_batches]
        for mb in consumer.micro_batches:
            for seq in mb.sequences:
                num_rows.update((ref.key, ref.num_tokens) for ref in seq.multimodal)
    encoders = EncoderAssignment(
        {placed[r.dp_rank]: [mb for mb in r.micro_batches if mb] for r in encoder}, num_rows
    )
    return encoders, BackboneAssignment(micro_batches, tuple(replicas.values()))
