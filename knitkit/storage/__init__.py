"""knitkit.storage: atomic-unit trajectory storage, topology-aware planning and THD packing (paper 5.2)."""

from knitkit.storage.backend import UnitBackend, UnitSpec
from knitkit.storage.balance import CostModel, karmarkar_karp, pack_by_budget, pack_ranks_by_budget
from knitkit.storage.consumer import (
    DeliveredMicroBatch,
    MicroBatchConsumer,
    ReorganizerDiedError,
    ReorganizerError,
)
from knitkit.storage.cp import cp_chunks, padded_lengths, rank_chunks
from knitkit.storage.disk import SafetensorsBackend
from knitkit.storage.index import HierarchicalIndex, IndexEntry
from knitkit.storage.memory import MemoryBackend
from knitkit.storage.packing import ReadInto, RowSpec, pack, pack_into, pack_layout
from knitkit.storage.payload import MultimodalInput, Trajectory, content_key, video_groups
from knitkit.storage.plan import (
    ConsumerPlan,
    EncoderPlan,
    EncoderRankPlan,
    EncoderTopology,
    MicroBatchPlan,
    MiniBatchPlan,
    SequenceSlice,
    Topology,
)
from knitkit.storage.planner import PlannerConfig, plan_encoder, plan_minibatch, planner_ms
from knitkit.storage.publication import Publisher
from knitkit.storage.reorganizer import Reorganizer
from knitkit.storage.reorganizer_process import Assignment, ReorganizerProcess
from knitkit.storage.sample_level import (
    LocalTrajectories,
    RankPosition,
    pack_local,
    read_share,
    share_reads,
)
from knitkit.storage.shm import SharedMemoryBackend
from knitkit.storage.slot_ring import RingClosedError, RingSpec, SlotRing
from knitkit.storage.store import TrajectoryStore
from knitkit.storage.synthetic import synthetic_metas, synthetic_trajectories

__all__ = [
    "Assignment",
    "ConsumerPlan",
    "CostModel",
    "DeliveredMicroBatch",
    "EncoderPlan",
    "EncoderRankPlan",
    "EncoderTopology",
    "HierarchicalIndex",
    "IndexEntry",
    "LocalTrajectories",
    "MemoryBackend",
    "MicroBatchConsumer",
    "MicroBatchPlan",
    "MiniBatchPlan",
    "MultimodalInput",
    "PlannerConfig",
    "Publisher",
    "RankPosition",
    "ReadInto",
    "Reorganizer",
    "ReorganizerDiedError",
    "ReorganizerError",
    "ReorganizerProcess",
    "RingClosedError",
    "RingSpec",
    "RowSpec",
    "SafetensorsBackend",
    "SequenceSlice",
    "SharedMemoryBackend",
    "SlotRing",
    "Topology",
    "Trajectory",
    "TrajectoryStore",
    "UnitBackend",
    "UnitSpec",
    "content_key",
    "cp_chunks",
    "karmarkar_karp",
    "pack",
    "pack_by_budget",
    "pack_into",
    "pack_layout",
    "pack_local",
    "pack_ranks_by_budget",
    "padded_lengths",
    "plan_encoder",
    "plan_minibatch",
    "planner_ms",
    "rank_chunks",
    "read_share",
    "share_reads",
    "synthetic_metas",
    "synthetic_trajectories",
    "video_groups",
]
