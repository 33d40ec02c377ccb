"""knitkit.storage: atomic-unit trajectory storage, topology-aware planning and THD packing (paper 5.2).

This is the user's face: write trajectories, plan an admitted mini-batch, serve it through
reorganizer processes and read it on each rank. Backend authors import
``knitkit.storage.backends``; planner extensions and engine adapters ``knitkit.storage.planning``
and ``knitkit.storage.delivery``; everything else is internal.
"""

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.backends.disk import SafetensorsBackend
from knitkit.storage.backends.lost import UnitsLostError
from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.backends.shard_header import CorruptShardError
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.consumer import (
    MicroBatchConsumer,
    ReorganizerDiedError,
    ReorganizerError,
)
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingSpec
from knitkit.storage.planning.packing import pack
from knitkit.storage.planning.plan import (
    ConsumerPlan,
    EncoderRankPlan,
    EncoderTopology,
    MicroBatchPlan,
    MiniBatchPlan,
    Topology,
)
from knitkit.storage.planning.planner import PlannerConfig, plan_minibatch
from knitkit.storage.units.payload import MultimodalInput, Trajectory, content_key, video_groups
from knitkit.storage.units.placement import PlacedTrajectory, UnitPlacer
from knitkit.storage.units.store import TrajectoryStore

__all__ = [
    "ConsumerPlan",
    "CorruptShardError",
    "EncoderRankPlan",
    "EncoderTopology",
    "MemoryBackend",
    "MicroBatchConsumer",
    "MicroBatchPlan",
    "MiniBatchPlan",
    "MultimodalInput",
    "PlacedTrajectory",
    "PlannerConfig",
    "ReorganizerDiedError",
    "ReorganizerError",
    "ReorganizerProcess",
    "RingSpec",
    "SafetensorsBackend",
    "SharedMemoryBackend",
    "Topology",
    "Trajectory",
    "TrajectoryStore",
    "UnitBackend",
    "UnitPlacer",
    "UnitsLostError",
    "content_key",
    "pack",
    "plan_minibatch",
    "video_groups",
]
