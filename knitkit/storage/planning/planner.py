"""The planner: from metadata alone, DP balance, CP split, micro-batches and encoder assignment."""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from knitkit.storage.planning.balance import CostModel, karmarkar_karp, pack_ranks_by_budget
from knitkit.storage.planning.cp import padded_lengths, rank_chunks
from knitkit.storage.planning.plan import (
    ConsumerPlan,
    EncoderPlan,
    EncoderRankPlan,
    EncoderTopology,
    MicroBatchPlan,
    MiniBatchPlan,
    Topology,
    check_metas,
    make_slices,
)
from knitkit.types import TrajectoryMeta, UnitKey


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    """How a mini-batch is cut for its consumers (topologies are passed separately)."""

    token_fields: tuple[str, ...] = ("tokens", "logprobs", "loss_mask")
    """Per-token fields every consumer reads for its sequence ranges."""
    scalar_fields: tuple[str, ...] = ("reward",)
    """Per-trajectory fields every CP rank of the owning DP rank reads whole."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of one micro-batch on one consumer (this CP rank's padded tokens);
    ``None`` packs each DP rank's share into ``min_micro_batches`` micro-batches."""
    min_micro_batches: int = 1
    cost: CostModel = field(default_factory=CostModel)
    keep_groups: bool = False
    """Keep the trajectories of one GRPO sample (``sample_id``) on one DP rank."""
    encoder_max_cost_per_micro_batch: float | None = None
    """Cost budget of one encoder micro-batch; ``None``: one encoder micro-batch per rank."""
    pad_multiple: int = 1
    """Extra padding: each CP chunk (the whole sequence at CP=1) becomes a multiple of this, i.e.
    sequences are padded to ``topology.pad_multiple * pad_multiple``; 16 for FP8 under
    Transformer Engine."""

    def __post_init__(self) -> None:
        budgets = {
            "max_tokens_per_micro_batch": self.max_tokens_per_micro_batch,
            "encoder_max_cost_per_micro_batch": self.encoder_max_cost_per_micro_batch,
        }
        for name, value in budgets.items():
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"PlannerConfig.{name}={value!r} must be > 0 (or None)")
        if isinstance(self.min_micro_batches, bool) or not (
            isinstance(self.min_micro_batches, int) and self.min_micro_batches >= 1
        ):
            raise ValueError(
                f"PlannerConfig.min_micro_batches={self.min_micro_batches!r} must be an int >= 1"
            )
        if isinstance(self.pad_multiple, bool) or not (
            isinstance(self.pad_multiple, int) and self.pad_multiple >= 1
        ):
            raise ValueError(
                f"PlannerConfig.pad_multiple={self.pad_multiple!r} must be an int >= 1 (16 for FP8)"
            )


def plan_minibatch(
    metas: Sequence[TrajectoryMeta],
    topology: Topology,
    config: PlannerConfig | None = None,
    encoders: Sequence[EncoderTopology] = (),
    minibatch_id: str = "",
) -> MiniBatchPlan:
    """Assign an admitted mini-batch's trajectories to every (DP, CP) consumer and encoder rank.

    Trajectories with ``accepted=False`` are dropped. Every DP rank gets the same number of
    micro-batches; every real token lands on exactly one (DP, CP) consumer.
    """
    # Planning allocates tens of thousands of small acyclic objects; the cyclic GC would
    # scan them repeatedly for nothing (about a quarter of the time at 4096 trajectories).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(metas, topology, config or PlannerConfig(), encoders, minibatch_id)
    finally:
        if was_enabled:
            gc.enable()


def _plan(
    metas: Sequence[TrajectoryMeta],
    topology: Topology,
    config: PlannerConfig,
    encoders: Sequence[EncoderTopology],
    minibatch_id: str,
) -> MiniBatchPlan:
    check_metas(metas)
    metas = [m for m in metas if m.accepted]
    # Column lists, read with C-level attrgetters: everything the loops below index.
    tids = list(map(attrgetter("trajectory_id"), metas))
    num_tokens = list(map(attrgetter("num_tokens"), metas))
    multimodal = list(map(attrgetter("multimodal"), metas))
    lengths = np.array(num_tokens, dtype=np.int64)
    padded = padded_lengths(lengths, topology.pad_multiple * config.pad_multiple)
    per_rank = _balance_dp(metas, config.cost(lengths), topology.dp, config.keep_groups)
    local = (padded // topology.cp).tolist()
    micro = pack_ranks_by_budget(
        [[local[i] for i in items] for items in per_rank],
        config.max_tokens_per_micro_batch,
        config.min_micro_batches,
    )
    # The loops below build one SequenceSlice per (trajectory, CP rank), the planner's main
    # cost at 4096 trajectories (make_slices builds them in C-level passes).
    padded_list = padded.tolist()
    chunks_by_cp = [rank_chunks(padded, topology.cp, r) for r in range(topology.cp)]
    consumers = []
    for dp_rank, items in enumerate(per_rank):
        for cp_rank in range(topology.cp):
            chunks = chunks_by_cp[cp_rank]
            slices = make_slices(items, tids, num_tokens, padded_list, chunks, multimodal)
            batches = tuple(
                MicroBatchPlan(
                    index,
                    tuple([slices[j] for j in bin_]),
                    config.token_fields,
                    config.scalar_fields,
                )
                for index, bin_ in enumerate(micro[dp_rank])
            )
            consumers.append(ConsumerPlan(dp_rank, cp_rank, batches))
    encoder_plans = tuple(
        plan_encoder(metas, e, config.encoder_max_cost_per_micro_batch) for e in encoders
    )
    return MiniBatchPlan(minibatch_id, topology, tuple(consumers), encoder_plans)


def plan_encoder(
    metas: Sequence[TrajectoryMeta],
    encoder: EncoderTopology,
    max_cost_per_micro_batch: float | None = None,
) -> EncoderPlan:
    """Balance the mini-batch's UNIQUE multimodal units of ``encoder.kinds`` over its DP ranks by cost.

    Independent of the backbone: a unit shared by n trajectories is encoded once, on one rank.
    A unit's cost is ``MultimodalRef.cost``, or its token count when the cost is 0.
    """
    # Keyed by (owner, field) tuples: UnitKey's own order and equality, hashed in C.
    costs: dict[tuple[str, str], float] = {}
    units: dict[tuple[str, str], UnitKey] = {}
    kinds = encoder.kinds
    for meta in metas:
        for ref in meta.multimodal:
            key = ref.key
            pair = (key.owner, key.field)
            if key.field in kinds and pair not in costs:
                costs[pair] = ref.cost or float(ref.num_tokens)
                units[pair] = key
    pairs = sorted(costs)
    keys = [units[p] for p in pairs]
    unit_costs = [costs[p] for p in pairs]
    per_rank = karmarkar_karp(unit_costs, encoder.dp)
    budget = None if max_cost_per_micro_batch is None else math.ceil(max_cost_per_micro_batch)
    whole = [math.ceil(c) for c in unit_costs]
    micro = pack_ranks_by_budget([[whole[i] for i in items] for items in per_rank], budget)
    ranks = tuple(
        EncoderRankPlan(
            encoder.name, r, tuple(tuple(keys[items[j]] for j in bin_) for bin_ in micro[r])
        )
        for r, items in enumerate(per_rank)
    )
    return EncoderPlan(encoder, ranks)


def _balance_dp(
    metas: Sequence[TrajectoryMeta], costs: np.ndarray, dp: int, keep_groups: bool
) -> list[list[int]]:
    """Trajectory indices per DP rank: KK with equal set sizes, over trajectories or GRPO groups."""
    if not keep_groups:
        return karmarkar_karp(costs.tolist(), dp, equal_size=True)
    index: dict[str, int] = {}
    codes = [index.setdefault(meta.sample_id, len(index)) for meta in metas]
    members: list[list[int]] = [[] for _ in index]
    for i, code in enumerate(codes):
        members[code].append(i)
    group_costs = np.bincount(codes, weights=costs, minlength=len(index)).tolist()
    return [
        sorted(i for g in part for i in members[g])
        for part in karmarkar_karp(group_costs, dp, equal_size=True)
    ]
