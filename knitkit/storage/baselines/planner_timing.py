"""Planner timing on synthetic metadata: design.md's ``planner_ms`` benchmark keys."""

from __future__ import annotations

import statistics
import time

from knitkit.storage.baselines.synthetic import synthetic_metas
from knitkit.storage.planning.plan import EncoderTopology, Topology
from knitkit.storage.planning.planner import PlannerConfig, plan_minibatch


def planner_ms(
    num_trajectories: int = 4096,
    topology: Topology | None = None,
    repeats: int = 5,
    seed: int = 0,
) -> float:
    """Median wall time (ms) over ``repeats`` of ``plan_minibatch`` on a synthetic mini-batch,
    after one untimed warm-up call.

    Default (design.md's ``planner_ms``): DP32 x CP2 x TP4, 4096 trajectories in GRPO groups of 8,
    lengths 1k-64k tokens, micro-batches of at most 64k tokens per consumer, one image per sample
    for a DP8 encoder. ``planner_ms.dp128_16k`` is DP128 x CP2 x TP4 with 16384 trajectories.
    """
    topology = topology or Topology(dp=32, cp=2, tp=4)
    metas = synthetic_metas(num_trajectories, group_size=8, seed=seed)
    config = PlannerConfig(max_tokens_per_micro_batch=65536, keep_groups=True)
    encoders = (EncoderTopology("vision", dp=8),)
    plan_minibatch(metas, topology, config, encoders)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan_minibatch(metas, topology, config, encoders)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
