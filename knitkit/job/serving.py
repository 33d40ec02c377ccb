"""The scheduler thread: serve every (mini-batch, pass) in order once its reads are produced."""

from __future__ import annotations

import threading
import time
from typing import Literal

import numpy as np

from knitkit.job.core import JobCore
from knitkit.job.errors import WriteBackMissingError
from knitkit.job.ledger import MiniBatchLedger
from knitkit.job.passes import Pass
from knitkit.metrics import MetricsObserver

IDLE_S = 0.2
"""How often an idle scheduler checks the pool's health and the pass deadline."""


class Scheduler:
    """Serves (mini-batch, pass) pairs strictly in order (see NOTE [ Driver threads ] in
    driver.py): waits until the pass's reads are produced, queues its assignments on the
    reorganizers, publishes its schedule record; pushes released mini-batches' figures to the
    observer; fails the job when a reorganizer dies, the control path to a node breaks
    (``NodeFailedError``) or a pass waits past ``pass_timeout_s``.

    Holds its position: the cursor (the next mini-batch position and pass index), when it began
    waiting for the pass at the cursor, what it waits for, and whether the schedule finished.
    """

    def __init__(
        self, core: JobCore, observe: MetricsObserver | None, *, pass_timeout_s: float
    ) -> None:
        self.core = core
        self.observe = observe
        self.pass_timeout_s = pass_timeout_s
        self.cursor = (0, 0)
        """The next (position in ``ledger.order``, pass index) to serve."""
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
                step = self._next()
                if step is None:
                    return
                if step == "finish":
                    core.schedule.finish()
                    with core.lock:
                        self.finished = True
                elif step != "idle":
                    self._serve(*step)
        except BaseException as error:
            if not core.stopping.is_set():
                core.part_failed(error)

    def _next(self) -> tuple[MiniBatchLedger, Pass] | Literal["idle", "finish"] | None:
        """The next (mini-batch, pass) whose reads are produced; ``"finish"`` once everything
        admitted is served after ``finish()``; ``"idle"`` after one wait of at most ``IDLE_S``
        (or with figures to push); ``None`` to stop."""
        core = self.core
        with core.lock:
            if core.stopping.is_set() or core.failure is not None:
                return None
            if core.ledger.to_observe:
                return "idle"
            position, index = self.cursor
            if position == len(core.ledger.order):
                if self.finishing and not self.finished:
                    return "finish"
                core.lock.wait(IDLE_S)
                return "idle"
            ledger = core.ledger.minibatches.get(core.ledger.order[position])
            if ledger is None:  # resumed: re-planned once re-written (NOTE [ Resume rule ])
                self.blocked = f"{core.ledger.order[position]} waits for re-written trajectories"
                core.lock.wait(IDLE_S)
                return "idle"
            pass_ = core.passes[index]
            now = time.monotonic()
            if not self._ready(ledger, pass_):
                self.blocked = self._lacking(ledger, pass_)
                if self.waiting_since is None:
                    self.waiting_since = now
                elif now - self.waiting_since > self.pass_timeout_s:
                    raise WriteBackMissingError(
                        f"{self.blocked} after {self.pass_timeout_s} s (pass_timeout_s): a writer "
                        "rank stopped sending its outputs"
                    )
                core.lock.wait(IDLE_S)
                return "idle"
            if self.waiting_since is not None:
                core.ledger.wait_s += now - self.waiting_since
                self.waiting_since = None
            self.blocked = ""
            core.store.backend.flush()  # a buffering backend (disk): reorganizers read its units
            core.ledger.counts["passes_served"] += 1
            ledger.passes[pass_.name].served = True
            last = index + 1 == len(core.passes)
            self.cursor = (position + 1, 0) if last else (position, index + 1)
            return ledger, pass_

    def _ready(self, ledger: MiniBatchLedger, pass_: Pass) -> bool:
        """Whether every field ``pass_`` reads is produced for the whole mini-batch: every
        group's outputs arrived, then verified in the store for every trajectory (once)."""
        core = self.core
        for name in pass_.reads:
            if name in core.rollout or name in ledger.produced:
                continue
            if ledger.lacking(name, core.writer_of[name]):
                return False
            incomplete = [
                (t, core.store.missing_ranges(t, name))
                for t in ledger.trajectories
                if not core.store.field_complete(t, name)
            ]
            if incomplete:
                raise WriteBackMissingError(
                    f"mini-batch {ledger.minibatch_id!r}: every group wrote back {name!r} but "
                    f"trajectories miss token ranges: {incomplete[:5]}"
                )
            ledger.produced.add(name)
        return True

    def _lacking(self, ledger: MiniBatchLedger, pass_: Pass) -> str:
        """What ``pass_`` still waits for, from which groups (for progress and errors)."""
        core = self.core
        lacking = []
        for name in pass_.reads:
            if name in core.rollout or name in ledger.produced:
                continue
            groups = sorted(ledger.lacking(name, core.writer_of[name]))
            lacking.append(f"{name} from {groups}")
        return f"{ledger.minibatch_id}/{pass_.name} waits for {'; '.join(lacking)}"

    def _serve(self, ledger: MiniBatchLedger, pass_: Pass) -> None:
        """Queue the pass's assignments on the reorganizers, then publish its schedule record
        (the mini-batch's plan travels with its first pass; ranks restrict it themselves)."""
        core = self.core
        plan = ledger.plan.with_fields(pass_.reads)
        for consumer in plan.stage_consumers(core.pipeline):  # a ring per (DP, CP, stage)
            core.pool.submit(consumer.name, ledger.minibatch_id, consumer)
        if pass_.encodes:
            for encoder in plan.encoders:
                for rank in encoder.ranks:
                    core.pool.submit(rank.name, ledger.minibatch_id, rank)
        arrays = {}
        if pass_ is core.passes[0]:
            arrays["plan"] = np.frombuffer(ledger.plan.to_json().encode(), np.uint8)
        core.schedule.send({"mb": ledger.minibatch_id, "pass": pass_.name}, arrays)

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
