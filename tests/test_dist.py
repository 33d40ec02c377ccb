"""The shared test-world helper: results come back in rank order; failures and hangs surface, never hang."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist import WorkerError, World


def _sum_of_ranks(rank: int, scale: float) -> float:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return float(t)


def _fail_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 blocks here until the world is torn down


def _sleep(rank: int) -> None:
    time.sleep(60)


def test_world_runs_jobs_reports_errors_and_times_out() -> None:
    """A real gloo world: results in rank order; a raising rank's traceback and a hang become WorkerError;
    the world restarts for the next job."""
    with World(2) as world:
        assert world.run(_sum_of_ranks, 2.0) == [2.0, 2.0]
        with pytest.raises(WorkerError, match="rank one is broken"):
            world.run(_fail_on_rank_one)
        assert world.run(_sum_of_ranks, 1.0) == [1.0, 1.0]
        with pytest.raises(WorkerError, match="timed out"):
            world.run(_sleep, timeout_s=2)  # the job sleeps 60 s: it cannot finish in time
