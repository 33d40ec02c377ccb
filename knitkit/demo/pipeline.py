"""The demo's live pipeline: rollout stand-in -> admission -> store -> planner -> reorganizers -> trainers."""

from __future__ import annotations

import math
import multiprocessing as mp
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

from knitkit.admission import MiniBatch, SourceQuota, build_controller
from knitkit.demo.figures import StepLog
from knitkit.demo.model import ModelSize
from knitkit.demo.rollout import RolloutConfig, stream_completions
from knitkit.demo.trainer import RankSetup, StepResult, run_rank
from knitkit.metrics import MetricsObserver
from knitkit.storage import (
    EncoderTopology,
    MiniBatchPlan,
    PlannerConfig,
    ReorganizerProcess,
    RingSpec,
    SharedMemoryBackend,
    Topology,
    TrajectoryStore,
    plan_minibatch,
)
from knitkit.storage.baselines import RankPosition, share_reads

TOKEN_FIELDS = ("tokens", "labels", "old_logprobs", "loss_mask", "routing")


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


@dataclass(slots=True)
class PipelineResult:
    """Everything the report needs from the live run."""

    steps: list[list[StepResult]] = field(default_factory=list)
    """Per optimizer step (mini-batch), every rank's result."""
    admission: dict[str, AdmissionRecord] = field(default_factory=dict)
    quotas: dict[str, int] = field(default_factory=dict)
    num_minibatches: int = 0
    knitkit_bytes_read: int = 0
    sample_level_bytes: int = 0
    bytes_consumed: int = 0
    units_left: int = -1
    wall_s: float = 0.0


def run_pipeline(
    config: PipelineConfig, progress: Callable[[str], None], observe: MetricsObserver
) -> PipelineResult:
    """Stream the rollout through admission into training; returns the measurements.

    ``progress`` gets status lines; ``observe`` each optimizer step's figures (``StepLog``).
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
    topology = Topology(dp=config.dp, cp=config.cp)
    world = config.dp * config.cp
    encoder_ranks = tuple(range(0, world, max(1, world // config.encoder_dp)))[: config.encoder_dp]
    planner = PlannerConfig(
        token_fields=TOKEN_FIELDS,
        scalar_fields=("advantage",),
        max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
        keep_groups=False,
    )
    total_minibatches = config.train_batches * config.num_minibatches
    with ExitStack() as stack:
        store = TrajectoryStore(SharedMemoryBackend(slab_bytes=64 << 20))
        stack.callback(store.close)
        slot_bytes = 8 << 20
        backbone = [
            stack.enter_context(
                ReorganizerProcess(
                    store.backend, RingSpec.new(num_slots=4, slot_bytes=slot_bytes, num_consumers=1)
                )
            )
            for _ in range(world)
        ]
        encoders = [
            stack.enter_context(
                ReorganizerProcess(
                    store.backend, RingSpec.new(num_slots=4, slot_bytes=slot_bytes, num_consumers=1)
                )
            )
            for _ in range(config.encoder_dp)
        ]
        setup = RankSetup(
            world=world,
            cp=config.cp,
            port=_free_port(),
            backbone_rings=tuple(r.spec for r in backbone),
            encoder_rings=tuple(r.spec for r in encoders),
            encoder_ranks=encoder_ranks,
            size=config.size,
            lr=config.lr,
            prefetch_depth=config.prefetch_depth,
        )
        ctx = mp.get_context("spawn")
        plan_queues = [ctx.Queue() for _ in range(world)]
        results = ctx.Queue()
        trainers = [
            ctx.Process(target=run_rank, args=(r, setup, plan_queues[r], results), daemon=True)
            for r in range(world)
        ]
        for p in trainers:
            p.start()
        stack.callback(_stop, trainers, plan_queues)
        progress(
            f"started {world} trainer ranks (DP={config.dp} x CP={config.cp}), "
            f"{world + config.encoder_dp} reorganizer processes"
        )
        log = StepLog(observe, store, (*backbone, *encoders))
        trained = 0
        pending: list[MiniBatchPlan] = []
        for completion in stream_completions(config.rollout):
            trajectory = completion.trajectory
            meta = store.write(trajectory)
            for name, controller in controllers.items():
                controller.report(meta)
                while (mb := controller.next_minibatch()) is not None:
                    _record(result.admission[name], mb, completion.time_s)
                    if name == "knittrans" and trained + len(pending) < total_minibatches:
                        plan = plan_minibatch(
                            mb.trajectories,
                            topology,
                            planner,
                            (EncoderTopology("vision", dp=config.encoder_dp),),
                            f"tb{mb.train_batch}-mb{mb.index}",
                        )
                        plan = store.register(plan)
                        log.admitted(plan.minibatch_id, controller)
                        _account(result, store, plan)
                        for reorganizer, consumer in zip(backbone, plan.consumers, strict=True):
                            reorganizer.submit(plan.minibatch_id, consumer)
                        for reorganizer, rank_plan in zip(
                            encoders, plan.encoders[0].ranks, strict=True
                        ):
                            reorganizer.submit(plan.minibatch_id, rank_plan)
                        for q in plan_queues:
                            q.put(plan)
                        pending.append(plan)
            while pending and not results.empty():
                trained = _collect(result, results, world, store, pending, trained, log)
        while pending:
            trained = _collect(result, results, world, store, pending, trained, log)
        unused = [m.trajectory_id for m in store.metas()]
        store.release(unused)
        result.units_left = len(list(store.backend.keys()))
        result.knitkit_bytes_read = sum(r.bytes_read for r in (*backbone, *encoders))
    result.wall_s = time.perf_counter() - start
    return result


def _record(record: AdmissionRecord, mb: MiniBatch, time_s: float) -> None:
    record.times_s.append(time_s)
    record.train_batch.append(mb.train_batch)
    counts: dict[str, int] = {}
    for meta in mb.trajectories:
        counts[meta.source] = counts.get(meta.source, 0) + 1
    record.composition.append(counts)


def _account(result: PipelineResult, store: TrajectoryStore, plan: MiniBatchPlan) -> None:
    """Bytes this plan consumes, and what a sample-level read of the same plan would move."""
    spec = store.backend.spec
    for consumer in plan.consumers:
        for read in consumer.reads():
            rows = spec(read.key)
            if read.ranges is None:
                result.bytes_consumed += rows.nbytes
            else:
                result.bytes_consumed += rows.row_nbytes * sum(b - a for a, b in read.ranges)
        position = RankPosition(consumer.dp_rank, consumer.cp_rank, 0)
        result.sample_level_bytes += sum(spec(k).nbytes for k in share_reads(plan, position))
    for rank in plan.encoders[0].ranks:
        result.bytes_consumed += sum(spec(k).nbytes for k in rank.units)


def _collect(
    result: PipelineResult,
    results: mp.Queue,
    world: int,
    store: TrajectoryStore,
    pending: list[MiniBatchPlan],
    trained: int,
    log: StepLog,
) -> int:
    """Wait for every rank's result of the oldest pending mini-batch, free its units, log the step."""
    plan = pending.pop(0)
    step = []
    for _ in range(world):
        item = results.get(timeout=300)
        if isinstance(item, str):
            raise RuntimeError(f"a training rank failed:\n{item}")
        step.append(item)
    step.sort(key=lambda r: r.rank)
    result.steps.append(step)
    for consumer in plan.consumers:
        store.consumed(plan.minibatch_id, consumer.name)
    for rank in plan.encoders[0].ranks:
        store.consumed(plan.minibatch_id, rank.name)
    log.log(plan.minibatch_id, step[0].loss, [r.metrics for r in step])
    return trained + 1


def _stop(trainers: list, plan_queues: list) -> None:
    for q in plan_queues:
        q.put(None)
    for p in trainers:
        p.join(30)
        if p.is_alive():
            p.terminate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
