"""Roles of the driver-RSS test (test_control_across_nodes.py) on simulated nodes: ``driver
REORGANIZER_NODE`` (node 0) and ``writer BACKEND`` (node 1). The driver keeps metadata only: its
RSS stays flat while the payload per step grows 10x, with the rollout writer on another node
than the driver and the reorganizers on a third."""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path

NAMESPACE = "knitkit-driver-rss"
STEPS = 3
"""Steps at each payload size (the 1x steps first)."""
PER_STEP = 8
"""Trajectories per step: two GRPO groups of 4, one image per group."""
MARGIN = 12 << 20
"""Most the driver's RSS may grow over the 10x steps (they carry ~124 MiB of units)."""


def _sizes(scale: int) -> dict[str, int]:
    """synthetic_trajectories' sizes at payload ``scale`` (1 or 10): the same tokens and
    metadata, ``scale`` x the bytes per routing row and per image (~4.3 MiB a step at 1x)."""
    return {
        "min_tokens": 1024,
        "max_tokens": 1024,
        "routing_layers": 8 * scale,
        "image_patches": 256,
        "patch_dim": 512 * scale,
    }


def _rss() -> dict[str, int]:
    """This process's resident memory (kB lines of /proc/self/status), after a collection."""
    gc.collect()
    lines = Path("/proc/self/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines)
    return {k: int(fields[k].split()[0]) << 10 for k in ("VmRSS", "RssAnon", "RssShmem")}


def _driver(reorganizer_node: str) -> None:
    """Node 0: a job driver over a RayBackend whose reorganizers run on ``reorganizer_node``;
    adopts the JSON records on stdin; ``rss`` answers its RSS, ``metrics`` its figures."""
    import ray

    from knitkit.admission import build_controller
    from knitkit.integration.ray import RayBackend, RayDispatcher, RingConfig
    from knitkit.job import Driver, Pass
    from knitkit.storage import (
        EncoderTopology,
        PlacedTrajectory,
        PlannerConfig,
        Topology,
        TrajectoryStore,
    )

    ray.init(namespace=NAMESPACE, logging_level="ERROR")
    node = next(n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == reorganizer_node)
    backend = RayBackend()
    topology, encoder = Topology(dp=1, cp=1, tp=1), EncoderTopology("vision", dp=1)
    dispatcher = RayDispatcher(
        backend,
        topology,
        encoders=[encoder],
        placement={"backbone/dp0/cp0": node, "vision/dp0": node},
        ring=RingConfig(num_slots=2, slot_bytes=16 << 20),
    )
    config = Driver.Config(
        passes=(Pass("train", reads=("tokens", "logprobs", "routing", "reward"), encodes=True),),
        topology=topology,
        encoders=(encoder,),
        planner=PlannerConfig(max_tokens_per_micro_batch=2048),
        slot_bytes=16 << 20,
    )
    admission = build_controller(
        "streaming", train_batch_size=PER_STEP, num_minibatches=1, sources=["src0", "src1"]
    )
    print(json.dumps({"backend": backend.name}), flush=True)
    with config.build(admission=admission, store=TrajectoryStore(backend), pool=dispatcher) as job:
        for line in sys.stdin:
            if line.startswith("rss"):
                print(json.dumps(_rss()), flush=True)
            elif line.startswith("metrics"):
                print(json.dumps(job.metrics()), flush=True)
                break
            else:
                job.adopt(PlacedTrajectory.from_dict(json.loads(line)))
    dispatcher.close()
    backend.close()


def _writer(backend_name: str) -> None:
    """Node 1: place each step's trajectories (1x, then 10x) from this process and print each
    record; stay alive (the owner of the units) until stdin closes."""
    import ray

    from knitkit.integration.ray import RayBackend
    from knitkit.storage import UnitPlacer
    from knitkit.storage.baselines import synthetic_trajectories

    ray.init(namespace=NAMESPACE, logging_level="ERROR")
    placer = UnitPlacer(RayBackend(backend_name, create=False))
    for step, scale in enumerate([1] * STEPS + [10] * STEPS):
        placed_bytes = 0
        for trajectory in synthetic_trajectories(2, group_size=4, seed=step, **_sizes(scale)):
            renamed = dataclasses.replace(
                trajectory,
                trajectory_id=f"p{step}{trajectory.trajectory_id}",
                sample_id=f"p{step}{trajectory.sample_id}",
            )
            placed = placer.place(renamed)
            placed_bytes += sum(s.nbytes for s in placed.specs.values())
            print(json.dumps(placed.to_dict()), flush=True)
        print(json.dumps({"step": step, "placed_bytes": placed_bytes}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    {"driver": _driver, "writer": _writer}[sys.argv[1]](sys.argv[2])
