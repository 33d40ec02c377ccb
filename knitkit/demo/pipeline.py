"""The demo's main job: a driver in this process, training ranks spawned, each a RankHandle."""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess

from knitkit.admission import AdmissionController, MiniBatch, SourceQuota, build_controller
from knitkit.demo.accounting import BytesMoved, account
from knitkit.demo.model import ModelSize
from knitkit.demo.rollout import RolloutConfig, stream_completions
from knitkit.demo.trainer import PASSES, RankSetup, free_port, run_rank
from knitkit.job import Driver
from knitkit.metrics import MetricsObserver
from knitkit.storage import (
    EncoderTopology,
    PlannerConfig,
    SharedMemoryBackend,
    Topology,
    TrajectoryStore,
)
from knitkit.types import TrajectoryMeta


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Layout and sizes of the live run."""

    rollout: RolloutConfig
    dp: int = 2
    cp: int = 2
    encoder_dp: int = 2
    train_batch_size: int = 64
    num_minibatches: int = 4
    train_batches: int = 2
    quota_ratio: float = 0.24
    max_tokens_per_micro_batch: int = 192
    prefetch_depth: int = 2
    lr: float = 3e-3
    size: ModelSize = field(default_factory=ModelSize)


@dataclass(slots=True)
class AdmissionRecord:
    """When (simulated seconds) a policy admitted each mini-batch, and its per-source counts."""

    times_s: list[float] = field(default_factory=list)
    train_batch: list[int] = field(default_factory=list)
    composition: list[dict[str, int]] = field(default_factory=list)

    def add(self, train_batch: int, sources: Mapping[str, int], time_s: float) -> None:
        self.times_s.append(time_s)
        self.train_batch.append(train_batch)
        self.composition.append(dict(sources))


@dataclass(slots=True)
class PipelineResult:
    """Everything the report needs from the live run."""

    steps: list[dict[str, float]] = field(default_factory=list)
    """Per optimizer step (released mini-batch), the figures the driver pushed."""
    admission: dict[str, AdmissionRecord] = field(default_factory=dict)
    quotas: dict[str, int] = field(default_factory=dict)
    num_minibatches: int = 0
    knitkit_bytes_read: int = 0
    bytes: BytesMoved = field(default_factory=BytesMoved)
    units_left: int = -1
    wall_s: float = 0.0


def run_pipeline(
    config: PipelineConfig, progress: Callable[[str], None], observe: MetricsObserver
) -> PipelineResult:
    """Stream the rollout through admission into training; returns the measurements.

    ``progress`` gets status lines; ``observe`` each optimizer step's figures.
    """
    start = time.perf_counter()
    result = PipelineResult(num_minibatches=config.num_minibatches)
    sources = [p.name for p in config.rollout.sources]
    quotas = [SourceQuota(source=s, min_ratio=config.quota_ratio) for s in sources]
    controllers = {
        name: build_controller(
            name,
            train_batch_size=config.train_batch_size,
            num_minibatches=config.num_minibatches,
            sources=sources,
            quotas=quotas,
            group_size=config.rollout.group_size,
        )
        for name in ("knittrans", "barrier")
    }
    result.admission = {name: AdmissionRecord() for name in controllers}
    result.quotas = {s: math.ceil(config.quota_ratio * config.train_batch_size) for s in sources}

    def record(step: int, figures: Mapping[str, float]) -> None:
        result.steps.append(dict(figures))
        observe(step, figures)

    store = TrajectoryStore(SharedMemoryBackend(slab_bytes=64 << 20))
    driver = Driver.Config(
        passes=PASSES,
        topology=Topology(dp=config.dp, cp=config.cp),
        encoders=(EncoderTopology("vision", dp=config.encoder_dp),),
        planner=PlannerConfig(max_tokens_per_micro_batch=config.max_tokens_per_micro_batch),
        max_minibatches=config.train_batches * config.num_minibatches,
        slot_bytes=8 << 20,
        num_slots=4,
        write_back_slot_bytes=1 << 20,
        schedule_slot_bytes=1 << 20,
    ).build(admission=controllers["knittrans"], store=store, observe=record)
    try:
        with driver:
            ranks = _start_ranks(config, driver)
            world = config.dp * config.cp
            progress(
                f"started {world} trainer ranks (DP={config.dp} x CP={config.cp}), "
                f"{world + config.encoder_dp} reorganizer processes"
            )
            for completion in stream_completions(config.rollout):
                meta = driver.write(completion.trajectory)
                _admissions(driver, result, controllers["barrier"], meta, completion.time_s)
            driver.finish()
            _drain(driver, ranks)
            result.knitkit_bytes_read = int(
                driver.metrics()["knitkit/delivery/reorganizer_bytes_read"]
            )
        result.units_left = len(list(store.backend.keys()))
    finally:
        store.close()
    result.wall_s = time.perf_counter() - start
    return result


def _start_ranks(config: PipelineConfig, driver: Driver) -> list[SpawnProcess]:
    """One spawned process per (DP, CP) rank, each attached by the driver's spec alone."""
    world = config.dp * config.cp
    encoder_ranks = tuple(range(0, world, max(1, world // config.encoder_dp)))[: config.encoder_dp]
    setup = RankSetup(
        spec_json=driver.rank_spec().to_json(),
        world=world,
        cp=config.cp,
        port=free_port(),
        encoder_ranks=encoder_ranks,
        size=config.size,
        lr=config.lr,
        prefetch_depth=config.prefetch_depth,
    )
    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=run_rank, args=(r, setup), daemon=True) for r in range(world)]
    for rank in ranks:
        rank.start()
    return ranks


def _admissions(
    driver: Driver,
    result: PipelineResult,
    barrier: AdmissionController,
    meta: TrajectoryMeta,
    time_s: float,
) -> None:
    """Note the knittrans mini-batches the driver just admitted (with the bytes each pass will
    move), and run the barrier policy on the same stream for comparison."""
    knittrans = result.admission["knittrans"]
    for minibatch_id in driver.minibatches()[len(knittrans.times_s) :]:
        ledger = driver.ledger(minibatch_id)
        knittrans.add(ledger.train_batch, ledger.sources, time_s)
        account(result.bytes, driver.store, ledger.plan, PASSES)
    barrier.report(meta)
    while (mb := barrier.next_minibatch()) is not None:
        _record(result.admission["barrier"], mb, time_s)


def _record(record: AdmissionRecord, mb: MiniBatch, time_s: float) -> None:
    counts: dict[str, int] = {}
    for meta in mb.trajectories:
        counts[meta.source] = counts.get(meta.source, 0) + 1
    record.add(mb.train_batch, counts, time_s)


def _drain(driver: Driver, ranks: list[SpawnProcess]) -> None:
    """Wait for every admitted mini-batch to be trained, watching the rank processes."""
    deadline = time.monotonic() + 600
    while True:
        try:
            driver.drain(timeout_s=1.0)
            break
        except TimeoutError:
            dead = [r for r, p in enumerate(ranks) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"training ranks {dead} exited with codes {[ranks[r].exitcode for r in dead]}"
                    if dead
                    else "training timed out"
                ) from None
    for rank in ranks:
        rank.join(60)
        if rank.is_alive():
            rank.terminate()
