"""What the driver's parts share: one lock, the store, the passes, the pool, the ledger, the failure."""

from __future__ import annotations

import contextlib
import threading
import traceback
from dataclasses import dataclass, field

from knitkit.job.control import Control, ScheduleSink
from knitkit.job.errors import DriverFailedError, JobError, RankFailedError
from knitkit.job.ledger import JobLedger
from knitkit.job.passes import Pass, rollout_fields, written_by
from knitkit.job.pool import ReorganizerPool, minibatch_of
from knitkit.job.spec import data_rings
from knitkit.metrics import merge
from knitkit.storage import TrajectoryStore


@dataclass(slots=True)
class JobCore:
    """The driver's shared state; every field is read and written under ``lock`` (see NOTE
    [ Driver threads ] in driver.py), except the thread-safe ``stopping`` event."""

    passes: tuple[Pass, ...]
    store: TrajectoryStore
    pool: ReorganizerPool
    control: Control
    """The driver's channels to its ranks (NOTE [ Control across nodes ] in control.py)."""
    pipeline: int = 1
    """Pipeline stages: each (DP, CP) group has a data ring per stage (``data_rings``)."""
    liveness_timeout_s: float = 30.0
    """The job's liveness bound; also how long a rank's report of a failed reorganizer waits
    for the pool's own (NOTE [ A rank's producer failure ])."""
    lock: threading.Condition = field(
        default_factory=lambda: threading.Condition(threading.RLock())
    )
    ledger: JobLedger = field(default_factory=JobLedger)
    stopping: threading.Event = field(default_factory=threading.Event)
    failure: BaseException | None = None
    rollout: tuple[str, ...] = ()
    """Fields the passes read that no pass writes: the trajectories bring them."""
    writer_of: dict[str, Pass] = field(default_factory=dict)
    """Written field -> the pass that writes it."""
    unfreed: list[tuple[str, str]] = field(default_factory=list)
    """(mini-batch, store consumer) pairs that ended the mini-batch's last pass, whose units
    the scheduler frees once the consumer's reorganizer published the mini-batch
    (``free_published``)."""

    def __post_init__(self) -> None:
        self.rollout = rollout_fields(self.passes)
        self.writer_of = written_by(self.passes)

    @property
    def schedule(self) -> ScheduleSink:
        """The driver -> ranks channel (the scheduler publishes; ``fail`` fails it for every
        rank)."""
        return self.control.schedule

    def fail(self, error: BaseException) -> None:
        """Record the first failure, wake every waiter, and fail the schedule so every rank
        raises ``DriverFailedError`` with its message."""
        with self.lock:
            if self.failure is not None:
                return
            self.failure = error
            self.lock.notify_all()
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        with contextlib.suppress(Exception):  # a closing ring: the failure is recorded anyway
            self.schedule.fail(f"the driver failed: {text}")

    def part_failed(self, error: BaseException) -> None:
        """A part failed (the scheduler's checks or serving, a collector): ``fail`` with the
        control plane's diagnosis, the lost node's error if that is the cause (NOTE [ One error
        for a lost node ] in integration/ray/relay.py), or the pool's error where a rank raised
        because its reorganizer failed (NOTE [ A rank's producer failure ]). Never under the
        lock: it may wait."""
        if self.failure is None:
            error = self.control.diagnose(error)
        if isinstance(error, RankFailedError) and error.producer_failed:
            with self.lock:  # the scheduler, woken, checks the pool at once (IDLE_S otherwise)
                self.lock.notify_all()
                self.lock.wait_for(
                    lambda: self.failure is not None or self.stopping.is_set(),
                    self.liveness_timeout_s,
                )
        self.fail(error)

    # NOTE [ A rank's producer failure ]: a reorganizer that dies or fails is seen by the
    # driver's pool (the scheduler's ``pool.check``: a process's exit code, a Ray actor's failed
    # call) and by the ranks it feeds (their data ring: its producer's pid gone, its heartbeat
    # silent past ``liveness_timeout_s``, or its error text). Whichever comes first failed the
    # job. The pool's error names the consumer group and its node, and says whether it was
    # restarted; a rank's ``RankFailedError`` names a ring and a pid. A rank often comes first:
    # its ring check runs every 0.25-2 s while it waits, and Ray reports an actor on a lost node
    # only once its calls fail. So tests/job/test_node_loss.py failed beside two busy loops on
    # the 2-core dev box (stop 51): the lost group's rank was still in its 'old' pass, saw the
    # actor's pid gone and reported first, and the driver failed with that rank's error instead
    # of the lost node's. Now a rank's ``error`` record says when a reorganizer's failure or
    # death made it raise (``cause``: ``producer_failed`` on the error chain, as its traceback
    # shows it), and the collector's ``RankFailedError`` waits, at most ``liveness_timeout_s``,
    # for another part to fail the job first, waking the scheduler to check the pool now; the
    # rank's error stands once the bound passes (a producer alive to the pool but silent to the
    # rank). Why not let the collector call ``pool.check`` itself: the scheduler thread is the
    # pool's only caller. Why not read the rank's message: the cause travels as a field.

    def free_published(self) -> None:
        """Free the units of every ended (mini-batch, consumer) whose reorganizer no longer has
        an assignment of the mini-batch to publish: a restarted one re-serves from the store
        what its predecessor may not have handed out, after the consumers may have ended (see
        NOTE [ Reorganizer restart ] in recovery.py). Scheduler thread: the pool's only caller."""
        with self.lock:
            waiting = []
            for minibatch_id, consumer in self.unfreed:
                rings = data_rings(consumer, self.pipeline)
                unpublished = (self.pool.unpublished(ring) for ring in rings)
                if any(minibatch_id == minibatch_of(i) for ids in unpublished for i in ids):
                    waiting.append((minibatch_id, consumer))
                else:
                    self.store.consumed(minibatch_id, consumer)
            self.unfreed = waiting

    def raise_failure(self) -> None:
        """Raise the recorded failure: the job error itself, anything else wrapped."""
        failure = self.failure
        if failure is None:
            return
        if isinstance(failure, JobError):
            raise failure
        raise DriverFailedError(f"the driver failed: {failure!r}") from failure

    def job_metrics(self) -> dict[str, float]:
        """The driver's own figures (see ``Driver.metrics``)."""
        counts = self.ledger.counts
        return {
            "knitkit/job/minibatches_admitted": float(len(self.ledger.order)),
            "knitkit/job/minibatches_released": float(self.ledger.released),
            "knitkit/job/passes_served": float(counts["passes_served"]),
            "knitkit/job/passes_consumed": float(counts["passes_consumed"]),
            "knitkit/job/write_back_records": float(counts["write_back_records"]),
            "knitkit/job/write_back_wakes": float(counts["write_back_wakes"]),
            "knitkit/job/write_back_bytes": float(counts["write_back_bytes"]),
            "knitkit/job/pass_wait_s": self.ledger.wait_s,
            "knitkit/job/trajectories_waiting": float(len(self.ledger.waiting)),
        }

    def parts_metrics(self) -> dict[str, float]:
        """The store's and the reorganizers' figures."""
        return merge(self.store.metrics(), self.pool.metrics())
