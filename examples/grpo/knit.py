"""The knitkit path: the driver on global rank 0 (admission, store, reorganizers), a Megatron per-rank handle on every rank."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.distributed as dist

from grpo.clock import StepClock
from grpo.config import GRPOConfig
from grpo.loss import sequence_weights
from grpo.resume import Checkpointing
from grpo.rollout import Group, RolloutStandIn, generate_group, parse_trajectory_id
from grpo.train import Dedup, StepRecord, Trainer, figure_names
from knitkit.admission import SourceQuota, build_controller
from knitkit.integration.megatron import (
    DedupVLMStep,
    MegatronLayout,
    MegatronRank,
    PackedShapes,
    megatron_batch,
)
from knitkit.integration.sglang import PayloadConfig, RolloutWriter
from knitkit.job import Driver, Output, Pass, RankHandle, RankSpec, broadcast_rank_spec
from knitkit.metrics import MetricsObserver, merge
from knitkit.microbatch_iter import MicroBatch
from knitkit.storage import MiniBatchPlan, PlannerConfig, Trajectory
from knitkit.types import TrajectoryMeta

ROLLOUT = ("tokens", "labels", "loss_mask")
"""Stored fields of the SGLang adapter every pass reads (next-token aligned)."""
PASSES = (
    Pass("old", reads=ROLLOUT, writes=(Output("old_logprobs"),), forward_only=True, encodes=True),
    Pass("ref", reads=ROLLOUT, writes=(Output("ref_logprobs"),), forward_only=True, encodes=True),
    Pass(
        "train",
        reads=(*ROLLOUT, "advantage", "reward", "old_logprobs", "ref_logprobs"),
        encodes=True,
    ),
)
"""GRPO's step: old log-probs and reference log-probs (forward-only, written back), then train."""
WRITES = {"old": "old_logprobs", "ref": "ref_logprobs"}
"""The field each forward-only pass writes, from the ``logprobs`` its loss dicts hold."""
DEPTH = 2
"""Micro-batches each rank's prefetch stages ahead of the one its loop holds."""
DATA_RING_SLOTS = DEPTH + 2
"""Slots of each data ring: room for the next pass's first ``DEPTH`` micro-batches while the
finished pass still holds its last two leases (NOTE [ Data ring slots ] in
knitkit/job/driver.py; 4 MiB of shared memory per ring here)."""


@dataclass(slots=True)
class ScoredSink:
    """Where ``RolloutWriter`` writes: the driver, each trajectory with its reward and advantage added.

    The SGLang adapter builds a trajectory from the request and ``/generate`` output alone; GRPO's
    scalars come from the whole group, known when its ``n`` outputs are in (``score`` first).
    """

    driver: Driver
    scores: dict[str, dict[str, float]] = field(default_factory=dict)

    def score(self, group: Group) -> None:
        for request, reward, advantage in zip(
            group.requests, group.rewards, group.advantages, strict=True
        ):
            self.scores[request.trajectory_id] = {"reward": reward, "advantage": advantage}

    def write(self, trajectory: Trajectory) -> TrajectoryMeta:
        scalars = self.scores.pop(trajectory.trajectory_id)
        trajectory.scalars = {k: np.float32(v) for k, v in scalars.items()}
        return self.driver.write(trajectory)


def build_driver(run: GRPOConfig, layout: MegatronLayout, **runtime: Any) -> Driver:
    """The driver: knittrans admission with a source quota, planning for this Megatron layout;
    ``runtime`` goes to ``Driver.Config.build`` (``store``, ``pool``, ``control``)."""
    rollout = run.rollout
    admission = build_controller(
        "knittrans",
        train_batch_size=run.train_batch_size,
        num_minibatches=run.num_minibatches,
        sources=rollout.sources,
        quotas=[SourceQuota(source=run.quota_source, min_ratio=run.quota_ratio)],
        group_size=rollout.group_size,
    )
    return Driver.Config(
        passes=PASSES,
        topology=layout.topology,
        encoders=(layout.encoder_topology(),),
        planner=PlannerConfig(max_tokens_per_micro_batch=run.max_tokens_per_micro_batch),
        max_minibatches=run.steps,
        slot_bytes=1 << 20,
        num_slots=DATA_RING_SLOTS,
        write_back_slot_bytes=1 << 20,
        schedule_slot_bytes=1 << 20,
    ).build(admission=admission, **runtime)


def grpo_batch(
    micro_batch: MicroBatch, *, sequences: int, shapes: PackedShapes | None = None
) -> dict[str, object]:
    """``megatron_batch`` (block-causal mask: megatron's local attention, CP = 1) plus GRPO's
    per-token ``weights`` for a mini-batch of ``sequences`` trajectories; ``shapes``: the rank's
    cache of micro-batch layouts (NOTE [ Conversion by layout ])."""
    shapes = shapes or PackedShapes()
    batch = megatron_batch(micro_batch, attention_mask=True, shapes=shapes)
    shape = shapes.get(micro_batch, attention_mask=True)
    loss_mask = batch["loss_mask"][0]
    weights = sequence_weights(loss_mask, shape.owner, shape.num_sequences, sequences)
    batch["weights"] = weights.unsqueeze(0)
    return batch


def trajectory_ids(plan: MiniBatchPlan) -> tuple[str, ...]:
    """Every trajectory of a mini-batch (each once: CP rank 0's slices), sorted."""
    return tuple(
        sorted(
            s.trajectory_id
            for consumer in plan.consumers
            if consumer.cp_rank == 0
            for mb in consumer.micro_batches
            for s in mb.sequences
        )
    )


def knitkit_loop(
    run: GRPOConfig,
    trainer: Trainer,
    observe: MetricsObserver | None = None,
    *,
    clock: StepClock | None = None,
    feed_ahead: bool = False,
    checkpoint: Checkpointing | None = None,
    spec: RankSpec | None = None,
) -> list[StepRecord]:
    """``run.steps`` GRPO steps fed by knitkit: the driver on global rank 0, a handle on every rank.

    Rank 0 writes the stand-in's groups through the SGLang adapter into the driver until the
    step's mini-batch is admitted (``feed_ahead``: every step's, before the first); then every
    rank takes the step's passes from its handle (old log-probs, reference log-probs, train),
    each under ``DedupVLMStep.run``. ``clock`` times each step's data path on this rank.
    ``checkpoint``: resume from its newest checkpoint (model, optimizer, driver, rollout) and
    save one at every ``every``-th step boundary; the history then holds the steps run here.
    ``spec``: the driver runs in a process of its own (``grpo/cluster.py``, ranks on other
    nodes); every rank got its spec, so no rank hosts a driver.
    """
    layout = MegatronLayout.from_parallel_state()
    driver = build_driver(run, layout) if dist.get_rank() == 0 and spec is None else None
    try:
        if spec is None:
            spec = broadcast_rank_spec(driver.rank_spec() if driver else None, src=0)
        shapes = PackedShapes()  # one cache for grpo_batch and the rank's scalar fields
        handle = MegatronRank.from_parallel_state(
            spec,
            to_batch=functools.partial(grpo_batch, sequences=run.minibatch_size, shapes=shapes),
            config=RankHandle.Config(depth=DEPTH),
            shapes=shapes,
        )
        try:
            history = _steps(
                run, trainer, driver, handle, observe, clock or StepClock(), feed_ahead, checkpoint
            )
        finally:
            handle.close()
            if checkpoint is not None:
                checkpoint.close()
        if driver is not None:
            driver.drain()  # every pass consumed and every mini-batch released; raises its failure
        return history
    finally:
        if driver is not None:
            driver.close()


def _steps(
    run: GRPOConfig,
    trainer: Trainer,
    driver: Driver | None,
    handle: MegatronRank,
    observe: MetricsObserver | None,
    clock: StepClock,
    feed_ahead: bool,
    checkpoint: Checkpointing | None,
) -> list[StepRecord]:
    models = {"old": trainer.policy, "ref": trainer.reference, "train": trainer.policy}
    dedup = {id(m): DedupVLMStep(m, vision="vision") for m in (trainer.policy, trainer.reference)}
    feed = _Feed(run, driver, checkpoint) if driver is not None else None
    coords = handle.handle.coords
    done = 0
    if checkpoint is not None:
        done = checkpoint.open(f"dp{coords.dp}-cp{coords.cp}", writer=coords.tp == 0)
        checkpoint.load_trainer(trainer)
        if feed is not None and done:
            feed.resume(checkpoint.knitkit_state(done))
    history = []
    for step in range(done + 1, run.steps + 1):
        if feed is not None and (step == done + 1 or not feed_ahead):
            feed.until_admitted(run.steps if feed_ahead else step)
            if feed_ahead or step == run.steps:
                feed.driver.finish()
        read_before = _bytes_read(driver)
        clock.start()
        figures: dict[str, float] = {}
        ids: tuple[str, ...] = ()
        for _ in PASSES:
            with clock.data("pass"):
                work = handle.next_pass()
                if work is None:
                    raise RuntimeError(f"the driver finished before step {step}'s passes")
            with clock.data("encoder_inputs"):  # read once per mini-batch, and routed
                work.work.encoder_inputs()  # this rank's unique images
                rank_route = work.route
            model = models[work.pass_.name]
            encode = work.encode_fn(model.module.vision.encode)
            route = Dedup(dedup[id(model)], rank_route, encode)
            with clock.data("batch"):  # the pass's prefetch iterator (started by then, or now)
                batches = work.data_iterator()
            data = clock.timed(batches, first="first_batch")
            with work:
                if work.pass_.forward_only:  # each micro-batch written back as computed
                    fields = {WRITES[work.pass_.name]: "logprobs"}
                    written = functools.partial(
                        work.writing_back, fields=fields, around=lambda: clock.data("write_back")
                    )
                    trainer.logprobs(model, data, work.num_micro_batches, route, wrap=written)
                else:
                    figures = trainer.train(data, work.num_micro_batches, route)
                    ids = trajectory_ids(work.work.plan)
                with clock.data("done"):
                    work.done()
            if checkpoint is not None:
                if checkpoint.ledger is not None:
                    mine = sorted(
                        s.trajectory_id
                        for mb in work.work.consumer.micro_batches
                        for s in mb.sequences
                    )
                    checkpoint.ledger.record(work.minibatch_id, work.pass_.name, mine)
                checkpoint.kill.hit("pass")
        timings = clock.stop()
        if driver is not None:  # the reorganizers read for every rank
            timings["bytes_read"] = _bytes_read(driver) - read_before
        history.append(StepRecord(step, ids, figures, timings))
        if observe is not None:
            extra = feed.driver.metrics() if feed is not None else {}
            observe(step, merge(extra, handle.metrics(), figure_names(figures)))
        if checkpoint is not None and (step % checkpoint.every == 0 or step == run.steps):
            checkpoint.save(step, trainer, lambda s=step: feed.state(s) if feed else {})
    return history


def _bytes_read(driver: Driver | None) -> float:
    """Payload bytes the driver's reorganizers have read from the store so far."""
    if driver is None:
        return 0.0
    return driver.metrics().get("knitkit/delivery/reorganizer_bytes_read", 0.0)


class _Feed:
    """Rank 0's rollout: the stand-in's groups through the SGLang adapter into the driver."""

    def __init__(self, run: GRPOConfig, driver: Driver, checkpoint: Checkpointing | None) -> None:
        self.driver = driver
        self.checkpoint = checkpoint
        self.rollout = RolloutStandIn(run.rollout)
        self.sink = ScoredSink(driver)
        self.writer = RolloutWriter(
            self.sink, PayloadConfig(image_token_id=run.rollout.image_token)
        )

    def until_admitted(self, count: int) -> None:
        """Write groups until ``count`` mini-batches are admitted."""
        while len(self.driver.minibatches()) < count:
            group = self.rollout.next_group()
            self.sink.score(group)
            self.writer.add_batch(group.requests, group.outputs)
            if self.checkpoint is not None:
                self.checkpoint.kill.hit("rollout")

    def state(self, trained: int) -> dict[str, object]:
        """The driver's and the rollout's state at a step boundary (``trained`` steps done)."""
        return {
            "driver": self.driver.state_dict(trained=trained),
            "rollout": self.rollout.state_dict(),
        }

    def resume(self, state: dict[str, object]) -> None:
        """Restore the driver and the rollout; re-write the trajectories the driver names (the
        stand-in regenerates them: NOTE [ Keyed rollout draws ]); in-flight prompts are
        re-issued by the rollout's own state, trajectories written after the checkpoint are
        dropped (see NOTE [ Resume rule ] in knitkit/job/checkpoint_state.py)."""
        self.driver.load_state_dict(state["driver"])  # type: ignore[arg-type]
        self.rollout.load_state_dict(state["rollout"])  # type: ignore[arg-type]
        wanted = self.driver.reissue()
        groups: dict[tuple[int, int], list[str]] = {}
        for tid in wanted:
            step, index, _ = parse_trajectory_id(tid)
            groups.setdefault((step, index), []).append(tid)
        for (step, index), ids in groups.items():
            group = generate_group(self.rollout.config, step, index)
            self.sink.score(group)
            keep = [i for i, r in enumerate(group.requests) if r.trajectory_id in set(ids)]
            for i, request in enumerate(group.requests):
                if i not in keep:
                    del self.sink.scores[request.trajectory_id]
            self.writer.add_batch(
                [group.requests[i] for i in keep], [group.outputs[i] for i in keep]
            )
            if self.checkpoint is not None:
                self.checkpoint.kill.hit("rollout")
