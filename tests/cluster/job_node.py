"""Run on simulated nodes: ``driver`` starts a one-rank job's driver and prints its ``RankSpec``
(JSON, one line), then holds it until its stdin closes; ``rank`` reads that line from stdin and
attaches rank 0's ``RankHandle``, printing what it raised (or ``attached``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "job"))

from job_harness import controller, driver_config, trajectories

from knitkit.job import RankCoords, RankHandle, RankSpec


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


if __name__ == "__main__":
    driver() if sys.argv[1] == "driver" else rank()
