"""The scheduler thread: serve each mini-batch's passes in order, to each group once its reads are produced."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from knitkit.job.core import JobCore
from knitkit.job.errors import WriteBackMissingError
from knitkit.job.ledger import MiniBatchLedger
from knitkit.job.passes import Pass
from knitkit.job.pool import pass_id
from knitkit.job.spec import group_name
from knitkit.metrics import MetricsObserver
from knitkit.storage import MiniBatchPlan

IDLE_S = 0.2
"""How often an idle scheduler checks the pool's health and the pass deadline."""

# NOTE [ Next pass per group ]:
# A pass that reads what an earlier pass wrote back (train reads old and reference log-probs)
# used to be served for the whole mini-batch at once, after EVERY group's write-backs were in,
# and every rank waited on that global schedule record: DP imbalance (the groups' last
# reference write-backs land 46-107 ms apart in ``benchmarks/grpo_step.py --quick``) became
# exposed data wait of the fast groups (~20 ms of the step's ~30), where the plain loop absorbs
# it in its gradient all-reduce. Now a group's next pass starts as soon as ITS inputs are
# produced:
# - Scheduler. One mini-batch is open at a time. Its first pass reads only rollout fields
#   (``check_passes``): it is served to every group at once with the schedule record that
#   carries the plan (the mini-batch's announcement). Each later pass is served PER GROUP: to
#   group g once every field the pass reads is produced for every trajectory g reads (per
#   trajectory, not per group: with CP, g's trajectories are shared with its DP rank's other CP
#   groups, so the write-backs of each group holding a piece of them must be in:
#   ``MiniBatchLedger.lacking_for``), verified in the store for those trajectories (a gap is
#   a ``WriteBackMissingError`` as before), and since then micro-batch by micro-batch (NOTE
#   [ Serving as write-backs arrive ]). Serving = queueing g's
#   assignments (one per pipeline stage) on its reorganizers; an encoder rank's assignment is
#   queued once per mini-batch, when the first group gets its first encoding pass (its units
#   are rollout fields; its consumers may sit in several groups; NOTE [ Encoder inputs once
#   per mini-batch ] in rank.py). The next mini-batch opens once every group got every
#   pass of the open one, so every ring still gets its assignments in the schedule's order,
#   (mini-batch, pass) by (mini-batch, pass): the same order on every rank of the ring.
# - No deadlock on a full schedule ring: the scheduler publishes a record (blocking while the
#   ring is full) only when every earlier mini-batch is served to every group, so every rank
#   can run everything announced before it without the scheduler.
# - Ranks. The schedule carries one record per mini-batch (its first pass, with the plan). The
#   later passes of a mini-batch are known statically, so a rank goes on to its next pass at
#   once and waits on its own data ring; each micro-batch carries ``pass_id(mini-batch,
#   pass)`` (the pool's tag) and the rank checks it, so a rank and its ring cannot disagree on
#   the schedule unnoticed. A rank's wait on a data ring hears of the driver through a watch
#   thread on the schedule ring (``DriverWatch`` in rank.py): the driver's failure interrupts
#   the wait at once as ``DriverFailedError``, its death within a liveness period as
#   ``DriverDiedError`` (also when its death took the reorganizer first): the bounds of a wait
#   on the schedule itself. Lifecycle table: docs/lifecycle.md.
# - Measured (``benchmarks/grpo_step.py --quick``, 4 interleaved runs each, load 3-23): exposed
#   data wait per step, slowest rank, 23-73 ms before, 12.5-18 ms after; "waiting for the next
#   pass" 15-54 ms before, 0.7-4.3 ms after (the imbalance now waits in train's gradient
#   all-reduce, as the plain loop's does).
# - Unchanged: the ledger's exactly-once and order guarantees (every group gets every pass
#   once, in order; pass ends and write-backs per group as before), ``pass_timeout_s`` (per
#   group, from when its previous pass was served), the write-back checks, and resume (NOTE
#   [ Resume rule ]: the scheduler re-opens the first untrained mini-batch from its first pass).

# NOTE [ Serving as write-backs arrive ]:
# Per group was not enough: a rank's next pass (GRPO's train after ref) waited at its first
# micro-batch for the whole round trip of the previous pass's LAST write-back (writer rank ->
# driver's collector -> scheduler -> reorganizer -> ring), with nothing left to compute
# beside it: ``benchmarks/grpo_step.py``'s "a pass's first micro-batch", 2.8 ms of the 3.6 ms
# exposed wait idle, 29 of 37 ms at load ~4 (stop 46's hop trace: 4.4 + 1.7 + 5.4 + 2.9 +
# 0.8 ms). Now a pass that reads written fields is served to a group micro-batch by
# micro-batch, as a prefix: micro-batches ``fed:k`` of the group's assignment are queued (an
# assignment of their own under the pass's id: the ring carries the pass's micro-batches in
# order as before, and a restarted reorganizer re-serves only parts not published) once
# every trajectory they hold has each field the pass reads written back (every piece of it:
# ``lacking_for`` over those micro-batches) and verified in the store (once per trajectory
# and field). When the next pass reads a pass's outputs, the writer rank sends the pass's
# FIRST ``values`` record as soon as it is written back (``PassWork.write_back``), so its round
# trip overlaps the writer's compute of the pass's later micro-batches and the reading pass's
# first micro-batch is in the ring when the pass ends; the others go with the pass's end, as
# before, and their round trip overlaps the reading pass's first micro-batch. Only the first:
# a record sent at once wakes the pass-end thread, the driver's collector and scheduler, the
# reorganizer, all beside the compute, and on rank 0 behind its GIL: every record at once cost
# ~1 ms more of "sending write-backs" per step (``grpo_step.py --quick``, 9 pairs at load 5-9).
# With every record in at once the group gets its whole assignment at once, as before. ``PassLedger.started``: groups served in part; ``submitted``: in full.
# Order, exactly-once and the write-back checks are unchanged: a prefix is served once, the
# next pass only once the group got this one whole.


@dataclass(slots=True)
class _Open:
    """The mini-batch being served: per group, the index of its next pass and since when it
    waits for it."""

    ledger: MiniBatchLedger
    next: dict[str, int]
    since: dict[str, float]
    fed: dict[str, int]
    """Per group: micro-batches of its next pass already queued (NOTE [ Serving as write-backs
    arrive ])."""
    encoded: bool = False
    """Whether the encoder ranks' assignments are queued (with the mini-batch's first encoding
    pass: NOTE [ Encoder inputs once per mini-batch ] in rank.py)."""
    plans: dict[str, MiniBatchPlan] = field(default_factory=dict)
    """Pass -> the plan restricted to its reads."""


@dataclass(frozen=True, slots=True)
class _Serve:
    """One step outside the lock: queue ``pass_``'s micro-batches ``spans[group]`` (start, stop)
    for each group (and the encoder ranks), then publish the mini-batch's schedule record
    (``announce``)."""

    ledger: MiniBatchLedger
    pass_: Pass
    plan: MiniBatchPlan
    spans: dict[str, tuple[int, int]]
    encoders: bool
    announce: bool


class Scheduler:
    """Serves each mini-batch's passes in order, to each (DP, CP) group as soon as the group's
    reads are produced (see NOTE [ Next pass per group ] and NOTE [ Driver threads ] in
    driver.py); pushes released mini-batches' figures to the observer; fails the job when a
    reorganizer dies, the control path to a node breaks (``NodeFailedError``) or a group waits
    for a pass's reads past ``pass_timeout_s``.

    Holds its position: the next mini-batch to open (``position`` in ``ledger.order``), the
    open one (per group: its next pass and since when it waits), since when some group waits,
    what it waits for, and whether the schedule finished.
    """

    def __init__(
        self, core: JobCore, observe: MetricsObserver | None, *, pass_timeout_s: float
    ) -> None:
        self.core = core
        self.observe = observe
        self.pass_timeout_s = pass_timeout_s
        self.position = 0
        """The next position in ``ledger.order`` to open (a resumed driver sets it)."""
        self.open: _Open | None = None
        self.waiting_since: float | None = None
        self.blocked = ""
        self.finishing = False
        """``Driver.finish`` was called: finish the schedule once everything admitted is served."""
        self.finished = False
        self.thread = threading.Thread(target=self._run, name="knitkit-driver", daemon=True)

    def _run(self) -> None:
        core = self.core
        try:
            while True:
                core.pool.check()
                core.control.check()
                core.free_published()
                self._push_observed()
                steps = self._next()
                if steps is None:
                    return
                if steps == "finish":
                    core.schedule.finish()
                    with core.lock:
                        self.finished = True
                elif steps != "idle":
                    core.store.backend.flush()  # a buffering backend (disk): reorganizers read it
                    for step in steps:
                        self._serve(step)
        except BaseException as error:
            if not core.stopping.is_set():
                core.part_failed(error)

    def _next(self) -> list[_Serve] | Literal["idle", "finish"] | None:
        """What to serve now: the next mini-batch's announcement, or the open one's passes to
        the groups whose reads are produced; ``"finish"`` once everything admitted is served
        after ``finish()``; ``"idle"`` after one wait of at most ``IDLE_S`` (or with figures to
        push); ``None`` to stop."""
        core = self.core
        with core.lock:
            if core.stopping.is_set() or core.failure is not None:
                return None
            if core.ledger.to_observe:
                return "idle"
            if self.open is None:
                return self._announce()
            steps = self._ready_steps(self.open)
            if self.open is not None and all(
                i == len(core.passes) for i in self.open.next.values()
            ):
                self.open = None
                self.position += 1
            if steps:
                return steps
            if self.open is not None:
                core.lock.wait(IDLE_S)
            return "idle"

    def _announce(self) -> list[_Serve] | Literal["idle", "finish"]:
        """Open the next mini-batch: its first pass to every group, with the schedule record."""
        core = self.core
        if self.position == len(core.ledger.order):
            if self.finishing and not self.finished:
                return "finish"
            core.lock.wait(IDLE_S)
            return "idle"
        ledger = core.ledger.minibatches.get(core.ledger.order[self.position])
        if ledger is None:  # resumed: re-planned once re-written (NOTE [ Resume rule ])
            self.blocked = f"{core.ledger.order[self.position]} waits for re-written trajectories"
            core.lock.wait(IDLE_S)
            return "idle"
        self.blocked = ""
        now = time.monotonic()
        groups = ledger.groups
        self.open = _Open(
            ledger, dict.fromkeys(groups, 0), dict.fromkeys(groups, now), dict.fromkeys(groups, 0)
        )
        whole = {g: (0, len(ledger.consumer(g).micro_batches)) for g in groups}
        return [self._step(self.open, core.passes[0], whole, announce=True)]

    def _ready_steps(self, open_: _Open) -> list[_Serve]:
        """Every (pass, group micro-batches) of the open mini-batch that can be served now, in
        pass order; fails a group that waited past ``pass_timeout_s``; keeps ``blocked``
        current."""
        core, ledger = self.core, open_.ledger
        now = time.monotonic()
        steps, lacking = [], []
        for index, pass_ in enumerate(core.passes):
            at = [g for g, i in open_.next.items() if i == index]
            if not at:
                continue
            spans = {}
            for group in at:
                start, stop = open_.fed[group], self._ready_upto(open_, pass_, group)
                if stop > start or stop == len(ledger.consumer(group).micro_batches):
                    spans[group] = (start, stop)
            if spans:
                steps.append(self._step(open_, pass_, spans, announce=False))
            for group in at:
                if open_.next[group] != index:
                    continue  # served whole now
                lacking.append((pass_, group))
                if now - open_.since[group] > self.pass_timeout_s:
                    raise WriteBackMissingError(
                        f"{self._lacking(ledger, [(pass_, group)])} after {self.pass_timeout_s} "
                        "s (pass_timeout_s): a writer rank stopped sending its outputs"
                    )
        self.blocked = self._lacking(ledger, lacking)
        if lacking and self.waiting_since is None:
            self.waiting_since = now
        elif not lacking and self.waiting_since is not None:
            core.ledger.wait_s += now - self.waiting_since
            self.waiting_since = None
        return steps

    def _step(
        self, open_: _Open, pass_: Pass, spans: dict[str, tuple[int, int]], *, announce: bool
    ) -> _Serve:
        """Book ``pass_``'s ``spans`` as served (under the lock; a group whose span ends its
        assignment goes on to its next pass) and say what to queue."""
        core, ledger = self.core, open_.ledger
        state = ledger.passes[pass_.name]
        state.started |= spans.keys()
        now = time.monotonic()
        for group, (_, stop) in spans.items():
            open_.since[group] = now
            open_.fed[group] = stop
            if stop == len(ledger.consumer(group).micro_batches):
                state.submitted.add(group)
                open_.next[group] += 1
                open_.fed[group] = 0
                if ledger.served(pass_.name):
                    core.ledger.counts["passes_served"] += 1
        encoders = pass_.encodes and not open_.encoded
        open_.encoded |= encoders
        plan = open_.plans.get(pass_.name)
        if plan is None:
            plan = open_.plans[pass_.name] = ledger.plan.with_fields(pass_.reads)
        return _Serve(ledger, pass_, plan, spans, encoders, announce)

    def _ready_upto(self, open_: _Open, pass_: Pass, group: str) -> int:
        """How many of ``group``'s micro-batches of ``pass_`` can be served: the longest
        prefix whose trajectories have every field the pass reads produced (NOTE [ Serving as
        write-backs arrive ])."""
        core, ledger = self.core, open_.ledger
        count = len(ledger.consumer(group).micro_batches)
        written = [n for n in pass_.reads if n not in core.rollout and n not in ledger.produced]
        upto = open_.fed[group]
        while upto < count and all(self._produced(ledger, group, upto, n) for n in written):
            upto += 1
        return upto

    def _produced(self, ledger: MiniBatchLedger, group: str, index: int, name: str) -> bool:
        """Whether written field ``name`` is in for every trajectory of ``group``'s micro-batch
        ``index``: the write-backs holding pieces of them arrived, then verified in the store
        (once per trajectory; once every trajectory's is, the field is produced for the
        mini-batch)."""
        core = self.core
        if ledger.lacking_for(group, name, core.writer_of[name], slice(index, index + 1)):
            return False
        verified = ledger.verified.setdefault(name, set())
        micro_batch = ledger.consumer(group).micro_batches[index]
        ids = [s.trajectory_id for s in micro_batch.sequences if s.trajectory_id not in verified]
        incomplete = [
            (t, core.store.missing_ranges(t, name))
            for t in ids
            if not core.store.field_complete(t, name)
        ]
        if incomplete:
            raise WriteBackMissingError(
                f"mini-batch {ledger.minibatch_id!r}: every group wrote back {name!r} for "
                f"{group}'s micro-batch {index} but its trajectories miss token ranges: "
                f"{incomplete[:5]}"
            )
        verified.update(ids)
        if len(verified) == len(ledger.trajectories):
            ledger.produced.add(name)
        return True

    def _lacking(self, ledger: MiniBatchLedger, waiting: list[tuple[Pass, str]]) -> str:
        """What the waiting (pass, group) pairs still wait for, from which groups (for progress
        and errors), e.g. ``tb0-mb1/train waits for old_lp from ['backbone/dp0/cp0']``."""
        core = self.core
        by_pass: dict[str, dict[str, set[str]]] = {}
        for pass_, group in waiting:
            fields = by_pass.setdefault(pass_.name, {})
            for name in pass_.reads:
                if name in core.rollout or name in ledger.produced:
                    continue
                lacking = ledger.lacking_for(group, name, core.writer_of[name])
                fields.setdefault(name, set()).update(lacking)
        parts = []
        for pass_name, fields in by_pass.items():
            text = "; ".join(f"{name} from {sorted(groups)}" for name, groups in fields.items())
            parts.append(f"{ledger.minibatch_id}/{pass_name} waits for {text}")
        return "; ".join(parts)

    def _serve(self, step: _Serve) -> None:
        """Queue the pass's assignments: with the mini-batch's first encoding pass to its first
        group, the encoder ranks' first, then its groups' (a reorganizer per pipeline stage);
        then publish the mini-batch's schedule record on its announcement (the plan travels with
        it; ranks restrict it themselves).

        Encoders first because a rank takes its encoder inputs before its first backbone
        micro-batch (the encoder forward feeds them): submitted last, the encoder reorganizers
        woke behind the groups' compiling and copying on shared cores (benchmarks/transfer.py,
        issue 31: the encoder micro-batch reached TP0/CP0 4-6 ms sooner in 3 of 3 pairs)."""
        core, ledger = self.core, step.ledger
        tag = pass_id(ledger.minibatch_id, step.pass_.name)
        if step.encoders:
            for encoder in step.plan.encoders:
                for rank in encoder.ranks:
                    core.pool.submit(rank.name, tag, rank)
        for consumer in step.plan.stage_consumers(core.pipeline):  # a ring per (DP, CP, stage)
            span = step.spans.get(group_name(consumer.dp_rank, consumer.cp_rank))
            if span is not None:
                core.pool.submit(consumer.name, tag, consumer.part(*span))
        if step.announce:
            plan = np.frombuffer(ledger.plan.to_json().encode(), np.uint8)
            core.schedule.send({"mb": ledger.minibatch_id, "pass": step.pass_.name}, {"plan": plan})

    def _push_observed(self) -> None:
        """Hand released mini-batches' figures to the observer, in order, from this thread."""
        core = self.core
        while True:
            with core.lock:
                if not core.ledger.to_observe:
                    return
                figures = core.ledger.to_observe.popleft()
                step = core.ledger.observed + 1
            if self.observe is not None:
                self.observe(step, figures)
            with core.lock:
                core.ledger.observed = step
                core.lock.notify_all()
