"""knitkit.storage: atomic-unit trajectory storage, topology-aware planning and THD packing (paper 5.2)."""

from knitkit.storage.backends.backend import UnitBackend, UnitSpec
from knitkit.storage.backends.disk import SafetensorsBackend
from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.backends.ranges import (
    ReadCounter,
    check_ranges,
    check_replacement,
    copy_ranges,
    destination,
    rows_of,
    spec_of,
)
from knitkit.storage.backends.segments import sweep_dead_segments
from knitkit.storage.backends.shard_header import CorruptShardError
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.backends.validate import SUPPORTED_DTYPES, check_unit
from knitkit.storage.delivery.consumer import (
    MicroBatchConsumer,
    ReorganizerDiedError,
    ReorganizerError,
)
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer import Reorganizer
from knitkit.storage.delivery.reorganizer_process import Assignment, ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingClosedError, RingSpec, SlotRing, unlink_ring
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
    Topology,
)
from knitkit.storage.planning.planner import PlannerConfig, plan_encoder, plan_minibatch
from knitkit.storage.units.index import HierarchicalIndex, IndexEntry
from knitkit.storage.units.payload import MultimodalInput, Trajectory, content_key, video_groups
from knitkit.storage.units.store import TrajectoryStore

__all__ = [
    "SUPPORTED_DTYPES",
    "Assignment",
    "ConsumerPlan",
    "CorruptShardError",
    "CostModel",
    "EncoderPlan",
    "EncoderRankPlan",
    "EncoderTopology",
    "FieldSchema",
    "HierarchicalIndex",
    "IndexEntry",
    "MemoryBackend",
    "MicroBatchConsumer",
    "MicroBatchPlan",
    "MiniBatchPlan",
    "MultimodalInput",
    "PlannerConfig",
    "Publisher",
    "ReadCounter",
    "ReadInto",
    "ReadMany",
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
    "check_ranges",
    "check_replacement",
    "check_unit",
    "content_key",
    "copy_ranges",
    "cp_chunks",
    "destination",
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
    "rows_of",
    "spec_of",
    "sweep_dead_segments",
    "unlink_ring",
    "video_groups",
]
