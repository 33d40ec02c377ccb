"""A rank's watch on its driver: the driver's failure or death ends the rank's waits on its data rings."""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Iterator

from knitkit.job.errors import DriverDiedError, DriverFailedError, JobError
from knitkit.job.pool import untagged
from knitkit.storage import ReorganizerDiedError, ReorganizerError, RingSpec
from knitkit.storage.delivery import LeaseSource, Producer, ProducerWatch, Take
from knitkit.types import PackedMicroBatch

DRIVER = Producer("driver", "restart the job")
"""How a rank's errors name the producer of its schedule."""

JOIN_S = 5.0
"""How long ``close`` waits for the watch thread (it leaves within one liveness period)."""


def driver_error(rank: int, error: ReorganizerError | ReorganizerDiedError) -> JobError:
    """The rank's named error for its schedule's producer (the driver) failing or dying."""
    if isinstance(error, ReorganizerDiedError):
        return DriverDiedError(f"rank {rank}: the driver is gone ({error})")
    return DriverFailedError(f"rank {rank}: {error}")


class DriverWatch:
    """Watches the driver's schedule ring from a daemon thread (``knitkit-driver-watch-<rank>``)
    while the rank waits on its data and encoder rings (NOTE [ Next pass per group ] in
    serving.py): once the driver failed (at once) or died (within a liveness period), every
    ``PassTake`` of the rank raises ``DriverFailedError`` / ``DriverDiedError``, one waiting in
    another thread included. A driver that is alive but silent (its heartbeat older than
    ``liveness_timeout_s``) counts as dead only while a take waits for its pass's first
    micro-batch (the one the driver's submission gates), as a wait on the schedule did: a driver
    process busy for a while (a long save) never fails ranks that do not wait for it. The
    rank's own pass-end thread failing interrupts its takes the same way (``interrupt``)."""

    def __init__(self, spec: RingSpec, rank: int, *, liveness_timeout_s: float) -> None:
        self.rank = rank
        self._watch = ProducerWatch(spec, producer=DRIVER, liveness_timeout_s=liveness_timeout_s)
        self._error: BaseException | None = None
        self._takes: weakref.WeakSet[PassTake] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._gated = 0
        """Takes waiting now for the first micro-batch of their pass."""
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"knitkit-driver-watch-{rank}", daemon=True
        )
        self._thread.start()

    def take(
        self,
        source: LeaseSource,
        count: int,
        expect: str,
        *,
        after: Gate | None = None,
        drained: Gate | None = None,
    ) -> PassTake:
        """Exactly ``count`` leases of the submitted assignment ``expect`` (``pass_id``); the
        first is taken once ``after`` is open, and ``drained`` opens once the last is taken."""
        take = PassTake(source, count, expect=expect, watch=self, after=after, drained=drained)
        with self._lock:  # after the error is set: a later take sees it (``raise_failure``)
            self._takes.add(take)
        return take

    def raise_failure(self) -> None:
        """Raise the driver's failure or death once the watch saw it, or what ``interrupt``
        was given (a fresh job error per call)."""
        error = self._error
        if isinstance(error, JobError):
            raise type(error)(str(error))
        if error is not None:
            raise error

    def interrupt(self, error: BaseException) -> None:
        """Fail every take of the rank with ``error`` (the rank's pass-end thread failed: NOTE
        [ Asynchronous pass ends ] in completion.py); the first error seen stays."""
        with self._lock:
            if self._error is None:
                self._error = error
            takes = list(self._takes)
        for take in takes:
            take.interrupt()

    def check_now(self) -> None:
        """Raise the driver's failure or death now, without waiting (a data ring whose
        reorganizer died or failed: the driver's death takes its reorganizers with it, and one
        whose launcher is gone fails its ring "closed by its owner")."""
        self.raise_failure()
        try:
            self._watch.check()
        except (ReorganizerError, ReorganizerDiedError) as error:
            raise driver_error(self.rank, error) from None

    @contextlib.contextmanager
    def gated(self, first: bool) -> Iterator[None]:
        """Around a take's wait: with ``first``, one for its pass's first micro-batch."""
        if not first:
            yield
            return
        with self._lock:
            self._gated += 1
        try:
            yield
        finally:
            with self._lock:
                self._gated -= 1

    def close(self) -> None:
        """Stop the thread and unmap; idempotent."""
        self._stop.set()
        self._watch.close()
        self._thread.join(JOIN_S)

    def _run(self) -> None:
        try:
            # returns once finished or stopped
            self._watch.wait(math.inf, self._stop, heartbeat=lambda: self._gated > 0)
        except (ReorganizerError, ReorganizerDiedError) as error:
            self.interrupt(driver_error(self.rank, error))


class Gate:
    """A one-way gate on a rank's data ring: open once a pass's every lease is taken, so the
    next pass's take may start (NOTE [ One pass ahead ] in rank.py)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def wait(self, stop: Callable[[], bool]) -> bool:
        """Until open (True) or ``stop()`` holds after a ``wake`` (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self._open or stop())
            return self._open

    def wake(self) -> None:
        """Make waiters check their ``stop`` again."""
        with self._cond:
            self._cond.notify_all()


class PassTake(Take):
    """Exactly ``count`` leases of one submitted assignment from a rank's ring: each checked to
    carry its ``pass_id``; the driver's failure or death raised as the rank's named error. With
    ``after``, nothing is taken before that gate opens (the previous pass's leases are all
    taken); ``drained`` opens once the last lease is taken. ``next_lease`` runs the same checks
    with a bound on the ring's wait: a CPU iterator over it hands out on the training loop's
    thread, with no prefetch thread (NOTE [ Inline hand-out ] in
    knitkit/microbatch_iter/worker.py)."""

    def __init__(
        self,
        source: LeaseSource,
        count: int,
        *,
        expect: str,
        watch: DriverWatch,
        after: Gate | None = None,
        drained: Gate | None = None,
    ) -> None:
        super().__init__(source, count)
        self.expect = expect
        self._source, self._watch = source, watch
        self._after, self._drained = after, drained
        self._stopped = False
        if drained is not None and count == 0:
            drained.open()

    def interrupt(self) -> None:
        self._stopped = True
        super().interrupt()
        if self._after is not None:
            self._after.wake()

    def __next__(self) -> PackedMicroBatch:
        return self._checked(None)

    def next_lease(self, timeout_s: float) -> PackedMicroBatch:
        """``next()``, the ring's wait bounded by ``timeout_s`` (then ``TimeoutError``)."""
        return self._checked(timeout_s)

    def _checked(self, timeout_s: float | None) -> PackedMicroBatch:
        """The next lease, checked to be the pass's (``timeout_s``: the ring's wait, default
        the consumer's ``wait_timeout_s``)."""
        if self.taken < self.count:
            self._watch.raise_failure()
            if self._after is not None and not self._after.wait(lambda: self._stopped):
                self._watch.raise_failure()  # interrupted by the watch, or by its owner
                raise StopIteration
        try:
            with self._watch.gated(self.taken == 0):
                lease = self._next(timeout_s)
        except (StopIteration, InterruptedError):
            if self.taken < self.count:  # interrupted by the watch, or by its owner
                self._watch.raise_failure()
            raise
        except (ReorganizerError, ReorganizerDiedError):
            self._watch.check_now()  # a driver's death takes its reorganizers with it
            raise
        if self._drained is not None and self.taken == self.count:
            self._drained.open()
        got = untagged(str(lease.layout.extra.get("minibatch_id", "")))
        if got != self.expect:
            lease.release()
            raise RuntimeError(
                f"rank {self._watch.rank}: {self._source.name} handed out a micro-batch of "
                f"{got!r} where this rank runs {self.expect!r}: the driver and this rank "
                "disagree on the schedule; restart the job"
            )
        return lease
