"""Planner timing on synthetic metadata: the ``planner_ms`` keys of benchmarks/README.md's contract."""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from knitkit.storage.baselines.synthetic import synthetic_metas
from knitkit.storage.planning.plan import EncoderTopology, Topology
from knitkit.storage.planning.planner import PlannerConfig, plan_minibatch


def planner_ms(
    num_trajectories: int = 4096,
    topology: Topology | None = None,
    repeats: int = 5,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median time on ``clock`` (ms; wall time by default, ``time.process_time`` for the CPU of
    this process) over ``repeats`` calls of ``plan_minibatch`` on a synthetic mini-batch, after
    one untimed warm-up call, in this process as it is (garbage collector on).

    As in a trainer, the previous plan stays alive while the next is planned, and each timed call
    includes the garbage collection its allocations leave due: ``plan_minibatch`` pauses the
    collector (NOTE [ Planner and the garbage collector ]), so that collection runs at the next
    allocation after it returns, which the timing makes.

    Default (the ``planner_ms`` workload of benchmarks/README.md): DP32 x CP2 x TP4, 4096 trajectories in GRPO groups of 8,
    lengths 1k-64k tokens, micro-batches of at most 64k tokens per consumer, one image per sample
    for a DP8 encoder. ``planner_ms.dp128_16k`` is DP128 x CP2 x TP4 with 16384 trajectories.
    """
    topology = topology or Topology(dp=32, cp=2, tp=4)
    metas = synthetic_metas(num_trajectories, group_size=8, seed=seed)
    config = PlannerConfig(max_tokens_per_micro_batch=65536, keep_groups=True)
    encoders = (EncoderTopology("vision", dp=8),)
    previous = plan_minibatch(metas, topology, config, encoders)
    times = []
    for _ in range(repeats):
        start = clock()
        plan = plan_minibatch(metas, topology, config, encoders)
        held = [previous, plan]  # the next allocation: runs the collection the call left due
        times.append((clock() - start) * 1e3)
        del held
        previous = plan  # the plan before is freed here, outside the timing
    return statistics.median(times)


def planner_figures(
    repeats: int = 15, timeout_s: float = 600.0, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """The ``planner_ms`` and ``planner_ms.dp128_16k``, timed on ``clock`` (a picklable function:
    ``time.perf_counter``, ``time.process_time``) in a fresh spawned process.

    A fresh interpreter holds only knitkit and its imports, so neither a benchmark's earlier
    phases (their heap, their threads) nor its warm caches change the figures; ``timeout_s``
    bounds the wait for the child.
    """
    context = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_contract_figures, repeats, clock).result(timeout=timeout_s)


def _contract_figures(repeats: int, clock: Callable[[], float]) -> dict[str, float]:
    return {
        "planner_ms": planner_ms(repeats=repeats, clock=clock),
        "planner_ms.dp128_16k": planner_ms(
            16384, Topology(dp=128, cp=2, tp=4), repeats=repeats, clock=clock
        ),
    }
