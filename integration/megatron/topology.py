"""knitkit's topology and encoder routing, read from megatron-core's ``parallel_state`` groups."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from knitkit.encoder_dedup import (
    BackboneAssignment,
    EncoderAssignment,
    RoutingPlan,
    RowSlice,
    build_routing_plan,
    row_slices,
)
from knitkit.storage import EncoderTopology, MicroBatchPlan, MiniBatchPlan, Topology
from knitkit.types import UnitKey

Coord = tuple[int, int, int]
"""A rank's place in Megatron's grid: ``(dp_rank, cp_rank, tp_rank)``."""


@dataclass(frozen=True, slots=True)
class MegatronLayout:
    """Where every rank of a PP=1 Megatron world sits in the DP x CP x TP grid, and what follows.

    The backbone ``topology`` feeds knitkit's planner; the vision encoder gets its own topology
    spanning the whole world (every rank encodes a disjoint share of the mini-batch's unique
    inputs, paper 5.3), and ``routing_plan`` turns a ``MiniBatchPlan`` into the encoder-dedup
    routes between encoding ranks and (DP, CP, TP) consumers.
    """

    topology: Topology
    coords: tuple[Coord, ...]
    """``coords[r]`` is global rank ``r``'s ``(dp_rank, cp_rank, tp_rank)``."""
    rank: int

    @classmethod
    def from_parallel_state(cls, sequence_parallel: bool = False) -> MegatronLayout:
        """Read the layout from an initialised ``parallel_state`` (a collective over the world)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron parallel_state is not initialised; call "
                "parallel_state.initialize_model_parallel(...) before MegatronLayout.from_parallel_state()"
            )
        if ps.get_pipeline_model_parallel_world_size() != 1:
            raise ValueError(
                f"pipeline_model_parallel_size={ps.get_pipeline_model_parallel_world_size()}; "
                "the knitkit Megatron adapter supports PP=1 (put the encoder on the first stage "
                "and route yourself for PP>1)"
            )
        topology = Topology(
            dp=ps.get_data_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
            tp=ps.get_tensor_model_parallel_world_size(),
            sequence_parallel=sequence_parallel,
        )
        mine = torch.tensor(
            [
                ps.get_data_parallel_rank(),
                ps.get_context_parallel_rank(),
                ps.get_tensor_model_parallel_rank(),
            ],
            dtype=torch.int64,
        )
        world = dist.get_world_size()
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        coords = tuple((int(t[0]), int(t[1]), int(t[2])) for t in gathered)
        return cls(topology, coords, dist.get_rank())

    @property
    def coord(self) -> Coord:
        return self.coords[self.rank]

    def encoder_topology(
        self, name: str = "vision", kinds: tuple[str, ...] = ("image", "video")
    ) -> EncoderTopology:
        """The encoder's own topology: one encoder DP rank per world rank (encoder DP rank = global rank)."""
        return EncoderTopology(name, dp=len(self.coords), kinds=kinds)

    def routing_plan(self, plan: MiniBatchPlan, encoder: str = "vision") -> RoutingPlan:
        """Encoder-dedup routes of one mini-batch for every world rank (pure; same on all ranks).

        Rank ``r`` encodes what encoder DP rank ``r`` of ``plan.encoder(encoder)`` holds and
        consumes, per micro-batch, the feature rows of its (DP, CP) consumer in placeholder order;
        the TP ranks of one (DP, CP) consumer are replicas that each return an owned slice.
        """
        if plan.topology != self.topology:
            raise ValueError(
                f"plan was made for {plan.topology}, but megatron runs {self.topology}; "
                "plan with MegatronLayout.topology"
            )
        encoder_plan = plan.encoder(encoder)
        if len(encoder_plan.ranks) != len(self.coords):
            raise ValueError(
                f"encoder {encoder!r} was planned over {len(encoder_plan.ranks)} ranks; the world "
                f"has {len(self.coords)}; plan it with MegatronLayout.encoder_topology()"
            )
        micro_batches: dict[int, list[tuple[RowSlice, ...]]] = {}
        replicas: dict[tuple[int, int], list[int]] = defaultdict(list)
        num_rows: dict[UnitKey, int] = {}
        for rank, (dp, cp, _) in enumerate(self.coords):
            consumer = plan.consumer(dp, cp)
            micro_batches[rank] = [feature_slices(mb) for mb in consumer.micro_batches]
            replicas[(dp, cp)].append(rank)
            for mb in consumer.micro_batches:
                for seq in mb.sequences:
                    num_rows.update({ref.key: ref.num_tokens for ref in seq.multimodal})
        encoders = EncoderAssignment(
            {r.dp_rank: r.micro_batches for r in encoder_plan.ranks}, num_rows
        )
        backbone = BackboneAssignment(micro_batches, tuple(replicas.values()))
        return build_routing_plan(encoders, backbone, len(self.coords))


def feature_slices(micro_batch: MicroBatchPlan) -> tuple[RowSlice, ...]:
    """Encoding rows a packed micro-batch consumes, in the order its placeholder tokens appear."""
    return tuple(
        piece for seq in micro_batch.sequences for piece in row_slices(seq.multimodal, seq.chunks)
    )
