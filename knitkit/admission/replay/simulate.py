"""Discrete-event replay of one trace through a disaggregated or a colocated rollout-to-training path."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from knitkit.admission.controller import AdmissionController, MiniBatch
from knitkit.admission.policies import build_controller
from knitkit.admission.predicates import CompletionQuota
from knitkit.admission.replay.feeder import Feeder
from knitkit.admission.replay.metrics import RunRecord
from knitkit.admission.replay.rollout import EventQueue, Job, RolloutPool
from knitkit.admission.replay.settings import ReplaySettings
from knitkit.admission.replay.trace import Trace

Progress = Callable[[], None]
"""Called once per train batch finished."""


def _controller(policy: str, trace: Trace, settings: ReplaySettings) -> AdmissionController:
    return build_controller(
        policy,
        train_batch_size=settings.train_batch_size,
        num_minibatches=settings.num_minibatches,
        sources=trace.sources,
        quotas=settings.quotas(),
        group_size=trace.group_size if settings.group_atomic else 1,
        max_staleness=settings.max_staleness,
        predicates=()
        if settings.completion_quota is None
        else (CompletionQuota(settings.completion_quota),),
    )


def run_disaggregated(
    trace: Trace,
    settings: ReplaySettings,
    policy: str,
    train_time_s: float,
    progress: Progress | None = None,
) -> RunRecord:
    """Rollout and training run concurrently; parameters sync to rollout after each train batch."""
    events, record = EventQueue(), RunRecord()
    ctl = _controller(policy, trace, settings)
    jobs: dict[str, Job] = {}
    trainer: deque[MiniBatch] = deque()
    state = {"busy": False, "steps": 0, "closed": 0, "trained": 0, "started": -1}
    n = settings.num_minibatches
    minibatch_s = train_time_s / n

    def on_finish(job: Job) -> None:
        jobs[job.trajectory_id] = job
        meta = job.meta()
        feeder.reported(meta)
        ctl.report(meta)
        pool.fill(settings.resume_penalty_s)
        admit()
        feeder.top_up()
        pool.fill(settings.resume_penalty_s)

    pool = RolloutPool(trace, settings.rollout_slots, events, on_finish)
    feeder = Feeder(trace, settings, pool, ctl)

    def start_steps() -> None:
        while (
            state["steps"] <= state["closed"]
            and state["steps"] < settings.train_batches + 1
            and pool.version >= state["steps"] - settings.max_ahead
        ):
            step = state["steps"]
            record.step_start[step] = events.now
            feeder.issue_step(step)
            state["steps"] += 1
            pool.fill(settings.resume_penalty_s)

    def admit() -> None:
        # Train batch k opens (its first mini-batch is admitted) only once
        # its rollout step k has started and the trainer has started train batch
        # k - trainer_lookahead, as a trainer that pulls its next batch does; within an open
        # batch admission is eager. Opening batches earlier lets them pile up admitted but
        # untrained, and their staleness grow with run length.
        while (
            ctl.train_batch < state["steps"]
            and ctl.train_batch <= state["started"] + settings.trainer_lookahead
            and (mb := ctl.next_minibatch())
        ):
            record.admit(mb.train_batch, mb.index, events.now, [t.source for t in mb.trajectories])
            trainer.append(mb)
            if mb.index == n - 1:
                state["closed"] += 1
                start_steps()
        train_next()

    def train_next() -> None:
        if state["busy"] or not trainer:
            return
        mb = trainer.popleft()
        state["busy"] = True
        if state["started"] < mb.train_batch:
            state["started"] = mb.train_batch
            events.at(events.now, admit)  # the next train batch may open now
        record.busy_s[mb.train_batch] = record.busy_s.get(mb.train_batch, 0.0) + minibatch_s
        events.at(events.now + minibatch_s, lambda: trained(mb))

    def trained(mb: MiniBatch) -> None:
        record.train(mb.train_batch, [jobs.pop(t.trajectory_id) for t in mb.trajectories])
        state["busy"] = False
        if mb.index == n - 1:
            record.train_end[mb.train_batch] = events.now
            state["trained"] += 1
            if progress:
                progress()
            events.at(events.now + settings.sync_time_s, lambda: synced(mb.train_batch))
        train_next()

    def synced(train_batch: int) -> None:
        pool.version = train_batch + 1
        if settings.partial_rollout == "abort_resume":
            pool.resume_at_new_version(settings.resume_penalty_s)
        start_steps()
        admit()  # a step started here may open a train batch whose units are all ready

    start_steps()
    events.run_until(lambda: state["trained"] >= settings.train_batches)
    if state["trained"] < settings.train_batches:
        raise RuntimeError(
            f"policy {policy!r} stalled in train batch {ctl.train_batch} after "
            f"{state['trained']} trained: {feeder.why_stalled()}"
        )
    return record


def run_colocated(
    trace: Trace, settings: ReplaySettings, progress: Progress | None = None
) -> RunRecord:
    """Rollout and training time-share one pool: rollout step k runs at version k, then trains.

    The train batch is admitted whole (barrier). Without partial rollout, unfinished and
    unadmitted trajectories are discarded at the end of each rollout step, so staleness is 0.
    Training time does not change what rollout produces here, so timings are rollout-only.
    """
    events, record = EventQueue(), RunRecord()
    ctl = _controller("barrier", trace, settings)
    jobs: dict[str, Job] = {}
    closed: list[MiniBatch] = []

    def on_finish(job: Job) -> None:
        jobs[job.trajectory_id] = job
        meta = job.meta()
        feeder.reported(meta)
        ctl.report(meta)
        pool.fill(settings.resume_penalty_s)
        while (mb := ctl.next_minibatch()) is not None:
            record.admit(mb.train_batch, mb.index, events.now, [t.source for t in mb.trajectories])
            closed.append(mb)
        feeder.top_up()
        pool.fill(settings.resume_penalty_s)

    pool = RolloutPool(trace, settings.rollout_slots, events, on_finish)
    feeder = Feeder(trace, settings, pool, ctl)
    for k in range(settings.train_batches):
        pool.version = k
        record.step_start[k] = events.now
        feeder.issue_step(k)
        pool.fill(settings.resume_penalty_s)
        events.run_until(lambda: len(closed) == settings.num_minibatches)
        if len(closed) < settings.num_minibatches:
            raise RuntimeError(
                f"colocated replay stalled in train batch {k}: {feeder.why_stalled()}"
            )
        record.train_end[k] = events.now
        for mb in closed:
            record.train(k, [jobs.pop(t.trajectory_id) for t in mb.trajectories])
        closed.clear()
        if settings.partial_rollout == "off":
            record.dropped += pool.drop_running() + ctl.discard_pending()
            jobs.clear()
        else:
            pool.pause_all()
        if progress:
            progress()
    return record
