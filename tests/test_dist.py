"""The shared test-world helper: results come back in rank order; failures and hangs surface, never hang."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from dist import WorkerError, World, lend, rank_state
from processes import gone, wait_until


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


def _dirty(rank: int) -> None:
    """Leave on this rank everything ``as_fresh`` puts back, as a careless job could."""
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from knitkit.integration.megatron import cpu as megatron_cpu

    megatron_cpu.initialize_model_parallel(tensor_parallel=2, seed=7)
    init_num_microbatches_calculator(rank, None, 4, 1, 1)
    RouterReplay.global_router_replay_instances.append(RouterReplay())
    os.environ["KNITKIT_TEST_LEFTOVER"] = "1"
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)


def test_a_lent_world_reads_as_a_fresh_one() -> None:
    """NOTE [ One gloo world per size for the suite ]: a rank dirtied in every way ``as_fresh``
    knows, while lent, differs from a fresh rank in each of them, and reads as the fresh one
    once the loan ends."""
    with World(2) as world:
        fresh = world.run(rank_state)
        with lend(world, timeout_s=60) as lent:
            assert lent.timeout_s == 60
            lent.run(_dirty)
            dirty = lent.run(rank_state)
        assert world.timeout_s == 120
        for rank in range(2):
            assert [k for k in fresh[rank] if fresh[rank][k] == dirty[rank][k]] == [], dirty[rank]
        now = world.run(rank_state)
        for rank in range(2):
            assert {k: v for k, v in now[rank].items() if v != fresh[rank][k]} == {}, rank


def test_a_world_stopped_while_it_starts_ends_the_ranks_it_started(monkeypatch) -> None:
    """A SIGTERM's ``SystemExit`` between two ranks' starts: leaving ``with World`` ends the rank
    already started and skips the one never started (joining it raised ``AssertionError`` over
    the ``SystemExit``, and the started rank was left running)."""
    from multiprocessing.process import BaseProcess

    started: list[BaseProcess] = []
    start = BaseProcess.start

    def start_one_then_exit(proc: BaseProcess) -> None:
        if started:
            raise SystemExit(128 + signal.SIGTERM)
        start(proc)
        started.append(proc)

    monkeypatch.setattr(BaseProcess, "start", start_one_then_exit)
    with pytest.raises(SystemExit), World(2) as world:
        world.run(_sum_of_ranks, 1.0)
    (proc,) = started
    pid = proc.pid
    assert pid is not None
    wait_until(lambda: gone(pid), f"rank pid {pid} gone")
