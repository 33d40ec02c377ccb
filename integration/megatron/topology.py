"""knitkit's topology and encoder routing, read from megatron-core's ``parallel_state`` groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from knitkit.encoder_dedup import RankRoute, route_rank
from knitkit.integration.megatron.device import collective_device
from knitkit.integration.megatron.pipeline import stage_group
from knitkit.storage import EncoderTopology, MiniBatchPlan, Topology

Coord = tuple[int, int, int]
"""A rank's place in Megatron's grid: ``(dp_rank, cp_rank, tp_rank)``."""


@dataclass(frozen=True, slots=True)
class MegatronLayout:
    """Where every rank of a Megatron world (of one pipeline stage) sits in the DP x CP x TP grid.

    The backbone ``topology`` feeds knitkit's planner; the vision encoder gets its own topology
    (``encoder_topology``), and ``route`` turns a ``MiniBatchPlan`` into this rank's encoder-dedup
    route between encoding ranks and (DP, CP, TP) consumers. Two encoder layouts:

    - replicated vision path (default): every world rank encodes a disjoint share of the
      mini-batch's unique inputs (paper 5.3); TP replicas each return an owned gradient slice;
    - TP-sharded vision path (``tp_sharded=True``, e.g. megatron's ``MultimodalProjector``): the
      TP ranks of one group encode the same units together, so units are spread over the DP x CP
      ranks and routed within each TP rank's DP x CP group.
    """

    topology: Topology
    coords: tuple[Coord, ...]
    """``coords[r]`` is global rank ``r``'s ``(dp_rank, cp_rank, tp_rank)``."""
    dp_cp_ranks: tuple[int, ...]
    """``dp_cp_ranks[r]``: global rank ``r``'s rank in its DP x CP group (megatron's ``dp_cp``)."""
    rank: int

    @classmethod
    def from_parallel_state(cls, sequence_parallel: bool = False) -> MegatronLayout:
        """Read the layout from an initialised ``parallel_state`` (a collective over the world).

        Under pipeline parallelism the layout is this stage's: ranks are ranks in the stage's
        TP x DP x CP group, identical in shape on every stage (see ``pipeline.py``).
        """
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron parallel_state is not initialised; call "
                "parallel_state.initialize_model_parallel(...) before MegatronLayout.from_parallel_state()"
            )
        topology = Topology(
            dp=ps.get_data_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
            tp=ps.get_tensor_model_parallel_world_size(),
            sequence_parallel=sequence_parallel,
        )
        # PP > 1: this stage's ranks (see NOTE [ Encoder under pipeline parallelism ] in pipeline.py)
        group = stage_group()
        mine = torch.tensor(
            [
                ps.get_data_parallel_rank(),
                ps.get_context_parallel_rank(),
                ps.get_tensor_model_parallel_rank(),
                ps.get_data_parallel_rank(with_context_parallel=True),
            ],
            dtype=torch.int64,
            device=collective_device(group),
        )
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        coords = tuple((int(t[0]), int(t[1]), int(t[2])) for t in gathered)
        return cls(topology, coords, tuple(int(t[3]) for t in gathered), dist.get_rank(group))

    @property
    def coord(self) -> Coord:
        return self.coords[self.rank]

    def encoder_topology(
        self,
        name: str = "vision",
        kinds: tuple[str, ...] = ("image", "video"),
        tp_sharded: bool = False,
    ) -> EncoderTopology:
        """The encoder's own topology: one encoder DP rank per world rank, or per DP x CP rank if TP-sharded."""
        if tp_sharded:
            return EncoderTopology(
                name, dp=self.topology.dp * self.topology.cp, tp=self.topology.tp, kinds=kinds
            )
        return EncoderTopology(name, dp=len(self.coords), kinds=kinds)

    def route(self, plan: MiniBatchPlan, encoder: str = "vision") -> RankRoute:
        """This rank's encoder-dedup route for one mini-batch (pure; computed alike on every rank).

        The route's ranks are world ranks for a replicated vision path and DP x CP group ranks for
        a TP-sharded one (``encoder_topology(tp_sharded=True)``); ``DedupVLMStep`` picks the
        matching process group.
        """
        if plan.topology != self.topology:
            raise ValueError(
                f"plan was made for {plan.topology}, but megatron runs {self.topology}; "
                "plan with MegatronLayout.topology"
            )
        encoder_plan = plan.encoder(encoder)
        sharded = encoder_plan.topology.tp > 1
        members = [r for r, c in enumerate(self.coords) if not sharded or c[2] == self.coord[2]]
        index = {r: (self.dp_cp_ranks[r] if sharded else r) for r in members}
        if len(encoder_plan.ranks) != len(members):
            raise ValueError(
                f"encoder {encoder!r} was planned over {len(encoder_plan.ranks)} ranks but routes "
                f"over {len(members)}; plan it with MegatronLayout.encoder_topology(tp_sharded=...)"
            )
        backbone = {index[r]: plan.consumer(*self.coords[r][:2]) for r in members}
        return route_rank(
            backbone, encoder_plan.ranks, world_size=len(members), rank=index[self.rank]
        )
