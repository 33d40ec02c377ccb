"""Planning and packing from metadata only: DP balance, CP split, encoder plans, THD layout (README steps 4, 5).

The face for planner extensions and engine adapters (a sampler balancing with
``karmarkar_karp``, a Megatron layout cutting CP chunks, a reorganizer host packing slots).
"""

from knitkit.storage.planning.balance import (
    CostModel,
    karmarkar_karp,
    pack_by_budget,
    pack_ranks_by_budget,
)
from knitkit.storage.planning.cp import cp_chunks, padded_lengths, rank_chunks
from knitkit.storage.planning.packing import (
    ReadInto,
    ReadMany,
    RowSpec,
    pack,
    pack_into,
    pack_into_batched,
    pack_layout,
)
from knitkit.storage.planning.plan import (
    ConsumerPlan,
    EncoderPlan,
    EncoderRankPlan,
    EncoderTopology,
    FieldSchema,
    MicroBatchPlan,
    MiniBatchPlan,
    SequenceSlice,
    StageLayers,
    Topology,
)
from knitkit.storage.planning.planner import PlannerConfig, plan_encoder, plan_minibatch

__all__ = [
    "ConsumerPlan",
    "CostModel",
    "EncoderPlan",
    "EncoderRankPlan",
    "EncoderTopology",
    "FieldSchema",
    "MicroBatchPlan",
    "MiniBatchPlan",
    "PlannerConfig",
    "ReadInto",
    "ReadMany",
    "RowSpec",
    "SequenceSlice",
    "StageLayers",
    "Topology",
    "cp_chunks",
    "karmarkar_karp",
    "pack",
    "pack_by_budget",
    "pack_into",
    "pack_into_batched",
    "pack_layout",
    "pack_ranks_by_budget",
    "padded_lengths",
    "plan_encoder",
    "plan_minibatch",
    "rank_chunks",
]
