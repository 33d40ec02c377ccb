"""A rank's pass ends off its training thread: records published and iterators closed, in order."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from knitkit.job.errors import JobError

JOIN_S = 5.0
"""How long ``stop`` waits for the thread once its current job gave up."""

# NOTE [ Asynchronous pass ends ]: a rank used to finish each pass on its training thread:
# close the pass's prefetch iterator (join its thread, release the last lease), take and
# release the encoder ring's copy of units it kept from an earlier pass, and publish its
# write-back and ``done`` records into the write-back ring (blocking while the ring is full,
# that is until the driver's collector took the earlier ones). ``benchmarks/grpo_step.py
# --quick`` showed 3-14 ms of "finishing passes" and 3-4 ms of "sending write-backs" per step
# on the slowest rank; profiled per pass (load ~14 on 2 cores): closing the iterator 0.2-13 ms
# (its thread's exit waits for a core), releasing encoder units 0.2-0.4 ms, publishing one
# record 0.1-11 ms (Python, and the GIL shared with the driver's threads on rank 0). Nothing
# the rank does next needs any of it: the driver, not the rank, waits for a pass's
# write-backs (NOTE [ Next pass per group ] in serving.py: the next pass's micro-batches reach
# the rank only once they are produced). Now ``RankHandle`` hands every such job to one thread
# per rank (``knitkit-pass-end-<rank>``), in order:
# - What waits, where. ``post`` returns once the job is queued; the rank waits only while
#   ``RankHandle.Config.sends_ahead`` jobs are queued (a driver that takes nothing), bounded by
#   the spec's ``wait_timeout_s`` (``TimeoutError`` naming the rank and what it queued). The
#   wait for a pass's write-backs moved to where their data is needed: the next pass's first
#   micro-batch, which the driver serves only once they arrived (its bound and the driver's
#   failure and death reach it as before: the rank's ``DriverWatch``). A clean ``close`` waits
#   for every job; ``metrics`` for none (a pass's iterator figures are added at its end, its
#   device copy time, ``h2d_s``, complete only once closed, when the thread closed it).
# - What stays on the training thread: a pass whose loop left micro-batches unread (closed
#   there, then it raises). Taking and releasing the encoder ring's copy of kept units stayed
#   there too until the jobs were held back (below), then was a held job; now the driver
#   serves the units once per mini-batch and there is no copy to release (NOTE [ Encoder
#   inputs once per mini-batch ] in rank.py).
# - When the thread runs. The thread and the training loop share one GIL: a job running
#   beside the loop's Python delays it (CPython hands the GIL back after its switch interval,
#   5 ms by default). Profiled with jobs run as soon as posted (``grpo_step.py --quick``, load
#   ~18): "sending write-backs" 7.6 ms per step instead of 0.3-0.6 ms, and the encoder-ring
#   release after a posted iterator close 1-11 ms per pass instead of 0.2-0.4 ms. So a pass's
#   jobs (its ``values`` records, its iterator's close) are held back (``post(now=False)``)
#   until the training thread finished its part of the pass's end (``RankHandle.pass_ended``;
#   a full queue runs them at once): the thread then works while the training thread waits for
#   its next pass's data or schedule, with the GIL released. A held job wakes nobody (no
#   notify; ``release`` notifies only when it lets jobs run): each wake had the idle thread
#   take the GIL from the training thread only to find nothing to run, once per write-back
#   record and twice per pass end (cProfile of a writer rank's "sending write-backs" in
#   ``grpo_step.py``, 6 steps, load ~10: 7.4 ms before, 2.8 ms after).
# - Order and exactly-once. One thread runs the jobs in the order posted, each once: a pass's
#   write-backs, its iterator's close, its ``done``, then the next pass's iterator start (NOTE
#   [ One pass ahead ] in rank.py) and its jobs (during a mini-batch's last pass, first a wait
#   for the next schedule record, which the training thread cancels before it queues anything:
#   NOTE [ One mini-batch ahead ] in rank.py): exactly the records, in the order, the
#   training thread published before (the driver's ledger checks them as before: every output
#   once, a group's pass end after its outputs).
# - Errors. A job that fails stops the thread (later jobs are dropped) and ``on_failure`` gets
#   the error at once: the writer rank fails its write-back ring (the driver fails naming the
#   rank) and the rank's ``DriverWatch`` interrupts its waits on data rings with it; every later
#   call of the handle raises it (a publication that found the driver gone:
#   ``DriverDiedError``). ``stop`` (a rank leaving through an exception) makes a publication
#   blocked on a full ring give up. Lifecycle table: docs/lifecycle.md.
# Why not wait at the pass's end for the driver to take the records (a synchronous hand-off):
# that is the wait this removes; and why not drop the ordering thread and let each record
# publish from whichever thread produced it: records of one ring must be published by one
# producer, in order.


class PassEnds:
    """One daemon thread that runs a rank's queued pass-end jobs in order (see NOTE
    [ Asynchronous pass ends ]): at most ``depth`` queued; waits bounded by ``timeout_s``."""

    def __init__(
        self,
        rank: int,
        *,
        depth: int,
        timeout_s: float,
        on_failure: Callable[[BaseException], None],
        on_start: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_start`` runs first on the thread (e.g. selecting the rank's CUDA device)."""
        if depth < 1:
            raise ValueError(f"sends_ahead={depth}; a rank queues at least one record")
        self.rank, self.depth, self.timeout_s = rank, depth, timeout_s
        self._on_failure, self._on_start = on_failure, on_start
        self._jobs: deque[tuple[int, str, Callable[[], None]]] = deque()
        self._cond = threading.Condition()
        self._posted = 0
        self._released = 0
        """Jobs up to this number may run (``post(..., now=False)`` holds them back)."""
        self._ran = 0
        self._running = ""
        self._failure: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"knitkit-pass-end-{rank}", daemon=True
        )
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a job is running now (e.g. a publication blocked on a full ring)."""
        return bool(self._running)

    def post(
        self,
        what: str,
        job: Callable[[], None],
        *,
        now: bool = True,
        timeout_s: float | None = None,
    ) -> int:
        """Queue ``job`` (``what`` names it in errors); returns its number for ``wait``.
        ``now=False`` holds it (and later ones) back until a job is posted with ``now`` or the
        queue is full. Waits only while ``depth`` jobs are queued or running, at most
        ``timeout_s`` (default: the bound given at construction); raises an earlier job's
        failure."""
        with self._cond:
            if self._posted - self._ran >= self.depth:
                self._released = self._posted  # a full queue runs what it holds
                self._cond.notify_all()
            self._wait_for(
                lambda: self._posted - self._ran < self.depth, f"to queue {what}", timeout_s
            )
            self._posted += 1
            self._jobs.append((self._posted, what, job))
            if now:
                self._released = self._posted
                self._cond.notify_all()  # a held job wakes nobody (NOTE [ Asynchronous pass ends ])
            return self._posted

    def release(self) -> None:
        """Let every job posted so far run (those posted with ``now=False``)."""
        with self._cond:
            if self._released < self._posted:
                self._released = self._posted
                self._cond.notify_all()

    def wait(self, number: int | None = None, *, timeout_s: float | None = None) -> None:
        """Until job ``number`` (default: every job posted) ran; raises a job's failure."""
        with self._cond:
            target = self._posted if number is None else number
            self._released = max(self._released, target)
            self._cond.notify_all()
            self._wait_for(lambda: self._ran >= target, "for its queued jobs", timeout_s)

    def raise_failure(self) -> None:
        """Raise the failure of a job, if one failed (a fresh error per call)."""
        failure = self._failure
        if failure is not None:
            raise _fresh(failure) from None

    def stop(self, timeout_s: float) -> None:
        """Run what is queued for at most ``timeout_s``, then drop the rest and stop the thread
        (the caller makes a job blocked on a ring give up first: ``RecordWriter.stop``)."""
        with self._cond:
            self._released = self._posted
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._jobs and not self._running, timeout_s)
            self._stopping = True
            self._jobs.clear()
            self._cond.notify_all()

    def join(self) -> None:
        self._thread.join(JOIN_S)

    def _wait_for(
        self, ready: Callable[[], bool], what: str, timeout_s: float | None = None
    ) -> None:
        """Under the lock: until ``ready()``; raises a failure; ``TimeoutError`` naming the job
        in progress after ``timeout_s`` (default: ``self.timeout_s``)."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        while True:
            self.raise_failure()
            if ready():
                return
            if self._stopping:
                raise RuntimeError(f"rank {self.rank}: the rank handle is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                queued = [w for _, w, _ in self._jobs]
                raise TimeoutError(
                    f"rank {self.rank} waited {bound} s {what}: its pass-end thread is still "
                    f"in {self._running or 'nothing'!r} with {queued[:4]} queued; the driver "
                    "takes none of its records (busy, stopped or unreachable): check the "
                    "driver's process, or raise wait_timeout_s"
                )
            self._cond.wait(left)

    def _run(self) -> None:
        try:
            self._on_start()
        except BaseException as error:
            with self._cond:
                self._failure = error
                self._cond.notify_all()
            return
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._stopping or (bool(self._jobs) and self._jobs[0][0] <= self._released)
                    )
                )
                if self._stopping:
                    return
                number, what, job = self._jobs.popleft()
                self._running = what
                self._cond.notify_all()
            try:
                job()
            except BaseException as error:
                with self._cond:
                    self._failure, self._running = error, ""
                    self._jobs.clear()
                    self._cond.notify_all()
                if not self._stopping:
                    self._on_failure(error)
                return
            with self._cond:
                self._ran, self._running = number, ""
                self._cond.notify_all()


def _fresh(error: BaseException) -> BaseException:
    """A new instance of a job error with the same message (raised once per caller)."""
    return type(error)(str(error)) if isinstance(error, JobError) else error
