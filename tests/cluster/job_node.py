"""Run on simulated nodes.

- ``driver``: a one-rank job's driver (``LocalControl``); prints its ``RankSpec`` (JSON, one
  line), then holds it until its stdin closes. ``rank``: reads that line from stdin and attaches
  rank 0's ``RankHandle``, printing what it raised (or ``attached``).
- ``ray-driver ADDRESS...``: the DP2 x TP2 job of ``JOB`` on the Ray cluster, rank ``r`` on the
  node at ``ADDRESS[r]``: ``RayBackend`` store, ``RayDispatcher`` reorganizers and ``RayControl``
  relays on the ranks' nodes. Prints the spec, writes every trajectory, drains, prints
  ``{"figures": ...}`` (or ``{"failed": error type, "message": ...}``), then holds the driver
  until its stdin closes (the ranks are done).
- ``ranks FIRST COUNT SPEC_FILE``: reads the spec from the file and runs ranks FIRST..FIRST+COUNT-1 of ``JOB``
  (threads, ``job_harness.rank_loop``); prints what each saw (JSON, one line).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "job"))

from job_harness import Seen, controller, driver_config, grid, join, run_ranks, trajectories

from knitkit.job import Driver, JobError, RankCoords, RankHandle, RankSpec
from knitkit.storage import Trajectory

JOB = {"dp": 2, "cp": 1, "tp": 2, "encoder_dp": 1, "samples": 4, "group": 2, "minibatches": 2}
"""The multi-node job: DP2 x TP2 (two ranks per node), one encoder rank, two mini-batches."""
WAIT_S = float(os.environ.get("KNITKIT_TEST_WAIT_S", "120"))
"""Bound of every wait of the job (a rank's, the driver's drain)."""
FIGURES = ("minibatches_released", "passes_consumed", "write_back_records", "write_back_bytes")
"""The driver's figures both runs of ``JOB`` must agree on (``knitkit/job/<name>``)."""


def job_config() -> Driver.Config:
    return driver_config(JOB["dp"], JOB["cp"], JOB["tp"], JOB["encoder_dp"], wait_timeout_s=WAIT_S)


def job_data() -> list[Trajectory]:
    return trajectories(JOB["samples"], JOB["group"], seed=5)


def job_coords() -> list[RankCoords]:
    return grid(JOB["dp"], JOB["cp"], JOB["tp"], JOB["encoder_dp"])


def figures(driver: Driver) -> dict[str, float]:
    metrics = driver.metrics()
    return {name: metrics[f"knitkit/job/{name}"] for name in FIGURES}


def seen_json(seen: Seen) -> dict[str, object]:
    """What one rank saw, as JSON: its tokens per ``"<mini-batch>/<pass>"``, mismatches, error."""
    return {
        "rank": seen.coords.rank,
        "tokens": {f"{mb}/{name}": tokens for (mb, name), tokens in seen.tokens.items()},
        "mismatches": seen.mismatches,
        "error": seen.error,
    }


def driver() -> None:
    data = trajectories(1, 2, seed=0)
    config = driver_config(1, 1, 1, 1, liveness_timeout_s=5.0, wait_timeout_s=30.0)
    with config.build(admission=controller(data, 1)) as job:
        print(job.rank_spec().to_json(), flush=True)
        sys.stdin.read()


def rank() -> None:
    spec = RankSpec.from_json(sys.stdin.readline())
    coords = RankCoords(rank=0, dp=0, cp=0, tp=0, encoder_rank=0)
    try:
        with RankHandle(spec, coords, device="cpu"):
            print("attached", flush=True)
    except Exception as error:
        print(f"{type(error).__name__}: {error}", flush=True)


def ray_driver(addresses: list[str]) -> None:
    import ray

    from knitkit.integration.ray import RayBackend, RayControl, RayDispatcher, RingConfig
    from knitkit.storage import TrajectoryStore

    ray.init(logging_level="ERROR", log_to_driver=False)
    ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    placement = [ids[address] for address in addresses]
    config, data = job_config(), job_data()
    groups = {c.rank: c for c in job_coords()}
    on = {  # every consumer group's reorganizer on the node of its ranks
        f"backbone/dp{c.dp}/cp{c.cp}": placement[r] for r, c in groups.items() if c.tp == 0
    }
    on.update(
        {
            f"vision/dp{c.encoder_rank}": placement[r]
            for r, c in groups.items()
            if c.encoder_rank is not None
        }
    )
    backend = RayBackend()
    pool = RayDispatcher(
        backend,
        config.topology,
        encoders=config.encoders,
        placement=on,
        ring=RingConfig(num_slots=config.num_slots, slot_bytes=config.slot_bytes),
    )
    with config.build(
        admission=controller(data, JOB["minibatches"]),
        store=TrajectoryStore(backend),
        pool=pool,
        control=RayControl(placement),
    ) as job:
        print(job.rank_spec().to_json(), flush=True)
        try:
            for trajectory in data:
                job.write(trajectory)
            job.finish()
            job.drain(300)
            print(json.dumps({"figures": figures(job)}), flush=True)
        except JobError as error:
            print(json.dumps({"failed": type(error).__name__, "message": str(error)}), flush=True)
        sys.stdin.read()
    backend.close()
    ray.shutdown()


def ranks(first: int, count: int, spec_file: str) -> None:
    spec = RankSpec.from_json(Path(spec_file).read_text())
    threads, seen = run_ranks(spec, job_coords()[first : first + count])
    join(threads, 300)
    print(json.dumps([seen_json(s) for s in seen]), flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "driver":
        driver()
    elif mode == "rank":
        rank()
    elif mode == "ray-driver":
        ray_driver(sys.argv[2:])
    else:
        ranks(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
