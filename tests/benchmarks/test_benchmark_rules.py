"""The benchmarks' fairness rules, checked on their own pieces (cheap: no benchmark is run)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from types import ModuleType, SimpleNamespace

import psutil
import pytest
from benchmark_scripts import load
from processes import BOUND_S, wait_until

from knitkit.storage import MemoryBackend, PlannerConfig, Topology, TrajectoryStore, plan_minibatch
from knitkit.storage.baselines import Arena, RankPosition, synthetic_trajectories


@pytest.fixture(scope="module")
def transfer() -> ModuleType:
    return load("transfer")


def test_quick_transfer_is_the_full_workload_over_fewer_steps(transfer: ModuleType) -> None:
    """--quick changes only the number of measured steps: every size of the step is the full
    run's, so its keys are comparable with the full run's."""
    full, quick = dataclasses.asdict(transfer.FULL), dataclasses.asdict(transfer.QUICK)
    assert quick.pop("steps") < full.pop("steps")
    assert quick == full


@pytest.mark.parametrize("depth", [1, 2])
def test_sample_level_thread_prepares_exactly_depth_ahead(transfer: ModuleType, depth: int) -> None:
    """The sample-level prefetch thread has exactly ``depth`` micro-batches packed beyond the one
    the loop holds, as knitkit's ring and TQ's loader do (equal look-ahead), and no more."""
    store = TrajectoryStore(MemoryBackend())
    trajectories = synthetic_trajectories(6, group_size=2, min_tokens=64, max_tokens=256)
    for trajectory in trajectories:
        store.write(trajectory)
    metas = store.metas([t.trajectory_id for t in trajectories])
    config = PlannerConfig(token_fields=("tokens", "logprobs"), min_micro_batches=6)
    plan = plan_minibatch(metas, Topology(dp=1), config)
    group = plan.consumer(0, 0)
    assert len(group.micro_batches) >= depth + 2
    rank = SimpleNamespace(
        setup=SimpleNamespace(plans=[plan]),
        backend=store.backend,
        groups=[group],
        rank=RankPosition(0, 0, 0),
        raw=Arena(),
        packed=[Arena() for _ in range(depth + 1)],
    )
    images = SimpleNamespace(share=lambda local: None)
    prefetch = transfer._SampleLevelPrefetch(rank, images, None, depth)
    prefetch.next()  # the loop holds micro-batch 0
    wait_until(
        lambda: prefetch._ready.qsize() >= depth and prefetch._credits._value == 0,
        "the prefetch thread staged its depth and waits for a credit",
    )
    assert prefetch._ready.qsize() == depth  # blocked for a buffer: no more than depth ahead
    for _ in group.micro_batches[1:]:
        prefetch.next()
    prefetch.join()


def test_one_ahead_thread_prepares_exactly_one_ahead() -> None:
    """prefetch.py's one-ahead thread baseline has one micro-batch copied beyond the one the
    loop holds: not zero (no overlap), not two."""
    prefetch = load("prefetch")
    source = prefetch.ShmReorganizer(4, 64, prep_ms=0.0, layers=2)
    try:
        loop = prefetch.OneAheadThread(source, "cpu")
        next(loop)
        wait_until(
            lambda: loop.ready.qsize() >= 1 and loop.credits._value == 0,
            "the one-ahead thread staged one and waits for a credit",
        )
        assert loop.ready.qsize() == 1
        for _ in range(3):
            next(loop)
        loop.close()
    finally:
        source.close()


def test_token_bins_keep_the_budget_and_every_row_once(transfer: ModuleType) -> None:
    """TransferQueue's micro-batches: every row exactly once, no bin over the budget unless one
    row alone exceeds it."""
    tokens = [900, 100, 4000, 50, 2048, 2048, 700, 3000, 9000]
    bins = transfer.token_bins(tokens, 4096)
    assert sorted(r for b in bins for r in b) == list(range(len(tokens)))
    assert all(sum(tokens[r] for r in b) <= 4096 or len(b) == 1 for b in bins)
    assert [b for b in bins if len(b) == 1 and tokens[b[0]] > 4096] == [[8]]


def test_cpu_meter_reads_another_process_in_nanoseconds(transfer: ModuleType) -> None:
    """The CPU meter reads a child's CPU-time clock (not /proc's 10 ms ticks), agreeing with
    /proc, and counts children that exited and were reaped."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend = time.process_time() + 0.3\n"
            "while time.process_time() < end: pass\ninput()",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        wait_until(
            lambda: sum(psutil.Process(child.pid).cpu_times()[:2]) >= 0.25,
            "the stand-in preparation burning CPU",
        )
        meter = transfer.CpuMeter()
        own = meter.own(child.pid)
        ticks = psutil.Process(child.pid).cpu_times()
        assert abs(own - (ticks.user + ticks.system)) < 0.05
        assert own != round(own, 2)  # finer than ticks
        assert meter.tree(os.getpid()) >= meter.own(os.getpid())
    finally:
        child.communicate(b"\n", timeout=BOUND_S)
    assert transfer.CpuMeter().own(child.pid) == 0.0  # gone: nothing, no error


def test_knitkit_delivery_counts_the_cpu_of_every_knitkit_process(transfer: ModuleType) -> None:
    """``knitkit.delivered_fraction_of_memcpy`` divides the delivered bytes by the CPU of every
    knitkit process (driver, ranks less their compute, reorganizers) over every regime, and each
    process's CPU is a key of its own; built from synthetic phase records (no benchmark run)."""
    steps, per_step = 4, 1_000_000
    work = SimpleNamespace(
        plans=[SimpleNamespace(num_micro_batches=5)] * (steps + transfer.WARMUP_STEPS),
        consumed={"fields": per_step * (steps + 1) // 2, "image": per_step * (steps + 1) // 2},
    )
    phases = transfer.schedule(with_tq=False)
    cpu = {"driver": 0.4, "reorganizer.dp0cp0": 0.8}  # seconds over a phase's measured steps
    cpu |= {f"rank.{transfer.rank_name(r)}": 0.5 for r in transfer.RANKS}
    compute_s = 0.3  # each rank's compute over the phase: not the data path's
    fill_s = 0.6  # the reorganizers' fills over a knitkit phase (NOTE [ Fill time ])
    records = {p.name: transfer._PhaseRecord([1.0] * steps, dict(cpu), fill_s) for p in phases}
    reads = {m: {"fields": 1, "image": 1} for m in ("sample_level", "sample_level_bcast")}
    got = [
        (rank, {p.name: ([0.01] * steps, compute_s) for p in phases}, reads)
        for rank in transfer.RANKS
    ]
    knitkit_read = {"fields": 3 * per_step * (steps + 1), "image": 0}  # every step, 3 regimes
    memcpy = 1e9
    figures = transfer.figures_of(work, phases, records, got, knitkit_read, memcpy)
    ranks = len(transfer.RANKS) * (0.5 - compute_s)
    per_phase = 0.4 + 0.8 + ranks
    assert figures["knitkit.cpu_s_per_step"] == pytest.approx(per_phase / steps)
    assert figures["knitkit.cpu_s_per_step.driver"] == pytest.approx(0.4 / steps)
    assert figures["knitkit.cpu_s_per_step.rank.dp1cp1tp1"] == pytest.approx(0.2 / steps)
    assert figures["knitkit.cpu_s_per_step.reorganizers"] == pytest.approx(0.8 / steps)
    assert figures["knitkit.delivered_fraction_of_memcpy"] == pytest.approx(
        per_step / (per_phase / steps) / memcpy
    )
    assert figures["knitkit.delivered_fraction_of_memcpy.reorganizers"] == pytest.approx(
        per_step / (0.8 / steps) / memcpy
    )
    # NOTE [ Delivery's floor ]: the fills alone, and the fills plus the oracle's own CPU
    assert figures["knitkit.fill_cpu_s_per_step"] == pytest.approx(fill_s / steps)
    assert figures["knitkit.delivered_fraction_of_memcpy.fills"] == pytest.approx(
        per_step / (fill_s / steps) / memcpy
    )
    oracle = figures["oracle.cpu_s_per_step"]
    assert oracle == pytest.approx(per_phase / steps)
    assert figures["knitkit.delivered_fraction_of_memcpy.ceiling"] == pytest.approx(
        per_step / (fill_s / steps + oracle) / memcpy
    )
    for method in ("knitkit", "sample_level"):
        for key in ("step_wall_s", "step_wall_overhead", "cpu_s_per_step", "bytes_read_ratio"):
            assert f"{method}.{key}" in figures
        for regime in transfer.REGIMES:
            assert f"{regime}.{method}.exposed_s_per_step" in figures
