"""Roles of the driver-RSS test (test_control_across_nodes.py) on simulated nodes: ``driver
CP0_NODE CP1_NODE`` (node 0), ``writer BACKEND`` (node 1), ``rank SPEC_FILE 0`` (node 2) and
``rank SPEC_FILE 1`` (node 1). The driver keeps metadata only: its RSS stays flat while the
payload per step grows 10x, with the rollout writer on another node than the driver and the
ranks (through ``RayControl``) of one DP rank's two CP groups on two nodes, whose forward-only
pass's write-backs are assembled and placed by the CP 0 rank's relay."""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "job"))

NAMESPACE = "knitkit-driver-rss"
STEPS = 2
"""Steps at each payload size (the 1x steps first)."""
PER_STEP = 8
"""Trajectories per step: two GRPO groups of 4, one image per group."""
WAIT_S = 120.0
"""Bound of the driver's drains and the rank's waits."""
MARGIN = 12 << 20
"""Most the driver's RSS may grow over the 10x steps (they carry ~83 MiB of units)."""


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


def _driver(cp0_node: str, cp1_node: str) -> None:
    """Node 0: the driver of a CP2 job of two ranks (``PASSES``: a forward-only pass writing a
    per-token output, a train pass reading it) over a RayBackend: rank 0 (CP 0, the encoder
    rank) on ``cp0_node``, rank 1 (CP 1) on ``cp1_node``, each group's reorganizer and a control
    relay beside its rank. Prints the backend's name and the rank spec; adopts the JSON records
    on stdin; ``rss`` drains what was admitted and answers its RSS; ``metrics`` finishes,
    drains and answers its figures."""
    import ray
    from job_harness import driver_config

    from knitkit.admission import build_controller
    from knitkit.integration.ray import RayBackend, RayControl, RayDispatcher, RingConfig
    from knitkit.storage import PlacedTrajectory, PlannerConfig, TrajectoryStore

    ray.init(namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
    ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    cp0, cp1 = ids[cp0_node], ids[cp1_node]
    backend = RayBackend()
    config = driver_config(
        1,
        2,
        1,
        1,
        planner=PlannerConfig(max_tokens_per_micro_batch=2048),
        slot_bytes=16 << 20,
        wait_timeout_s=WAIT_S,
    )
    dispatcher = RayDispatcher(
        backend,
        config.topology,
        encoders=config.encoders,
        placement={"backbone/dp0/cp0": cp0, "backbone/dp0/cp1": cp1, "vision/dp0": cp0},
        ring=RingConfig(num_slots=2, slot_bytes=16 << 20),
    )
    admission = build_controller(
        "streaming", train_batch_size=PER_STEP, num_minibatches=1, sources=["src0", "src1"]
    )
    with config.build(
        admission=admission,
        store=TrajectoryStore(backend),
        pool=dispatcher,
        control=RayControl([cp0, cp1]),
    ) as job:
        print(json.dumps({"backend": backend.name}), flush=True)
        print(job.rank_spec().to_json(), flush=True)
        for line in sys.stdin:
            if line.startswith("rss"):
                job.drain(WAIT_S)
                print(json.dumps(_rss()), flush=True)
            elif line.startswith("metrics"):
                job.finish()
                job.drain(WAIT_S)
                print(json.dumps(job.metrics()), flush=True)
                break
            else:
                job.adopt(PlacedTrajectory.from_dict(json.loads(line)))
        sys.stdin.read()  # the rank is done
    dispatcher.close()
    backend.close()


def _rank(spec_file: str, rank: str) -> None:
    """Rank ``rank`` of the job (``job_harness.rank_loop``: writes the forward-only pass's
    output, checks the train pass reads it back bit for bit); prints what it saw."""
    from job_harness import grid, rank_loop

    from knitkit.job import RankSpec

    coords = grid(1, 2, 1, 1)[int(rank)]
    seen = rank_loop(RankSpec.from_json(Path(spec_file).read_text()), coords)
    out = {"mismatches": seen.mismatches, "error": seen.error, "passes": len(seen.tokens)}
    print(json.dumps(out), flush=True)


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
    {"driver": _driver, "writer": _writer, "rank": _rank}[sys.argv[1]](*sys.argv[2:])
