"""The shared test-world helper: results come back in rank order; failures and hangs surface, never hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import WorkerError, World, lend, rank_state
from processes import BOUND_S, gone, kill_left, wait_until


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


def _pid_when_inside(rank: int, folder: str) -> None:
    """A job that never returns: its rank writes its pid to ``folder/<rank>`` and waits."""
    Path(folder, str(rank)).write_text(str(os.getpid()))
    threading.Event().wait()


_STARTER = """
import sys
from dist import World
from test_dist import _pid_when_inside

with World(2, timeout_s=600) as world:
    world.run(_pid_when_inside, sys.argv[1])
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_ranks_end_when_their_starter_dies(tmp_path, signum) -> None:
    """A process holding a world dies by ``signum`` (SIGTERM at its default disposition) while
    both ranks are inside a job that never returns: the ranks end too (they ran on for good,
    and an idle one waited on its inbox forever; NOTE [ Ranks end with their starter ])."""
    tests = Path(__file__).parent
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(tmp_path)], env=env, stderr=subprocess.PIPE
    )
    pids: list[int] = []
    try:
        files = [tmp_path / str(rank) for rank in range(2)]
        wait_until(
            lambda: all(f.exists() and f.read_text() for f in files) or starter.poll() is not None,
            "both ranks inside the job",
            bound_s=300,
        )
        assert starter.poll() is None, starter.communicate()[1].decode()[-2000:]
        pids += [int(f.read_text()) for f in files]
        starter.send_signal(signum)
        _, err = starter.communicate(timeout=BOUND_S)
        assert starter.returncode == -signum
        for pid in pids:
            wait_until(lambda pid=pid: gone(pid), f"rank pid {pid} gone")
        assert err.decode().count("the process that started the world") == 2, err.decode()[-2000:]
    finally:  # a failure leaves no rank behind either
        kill_left(pids)
        if starter.poll() is None:  # never a signal to the pid of a starter already reaped
            starter.kill()
        starter.wait()
