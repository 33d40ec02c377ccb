"""Not part of the data path: the sample-level baseline, synthetic payloads and planner timing, for benchmarks and tests."""

from knitkit.storage.baselines.arena import Arena
from knitkit.storage.baselines.planner_timing import planner_figures, planner_ms
from knitkit.storage.baselines.sample_level import (
    LocalTrajectories,
    RankPosition,
    pack_local,
    read_share,
    receive_multimodal,
    send_multimodal,
    share_reads,
)
from knitkit.storage.baselines.synthetic import synthetic_metas, synthetic_trajectories

__all__ = [
    "Arena",
    "LocalTrajectories",
    "RankPosition",
    "pack_local",
    "planner_figures",
    "planner_ms",
    "read_share",
    "receive_multimodal",
    "send_multimodal",
    "share_reads",
    "synthetic_metas",
    "synthetic_trajectories",
]
