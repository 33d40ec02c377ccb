"""Reorganizer restart: the driver replaces a dead pool member, its ranks follow it to its successor ring."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from knitkit.job.control import NodeAware
from knitkit.job.errors import ReorganizerFailedError
from knitkit.job.pool import Assignment, ReorganizerDied, ReorganizerPool, successor_ring
from knitkit.metrics import sum_over
from knitkit.storage import MicroBatchConsumer, ReorganizerDiedError, RingSpec
from knitkit.storage.delivery import RingNotReadyError, Take
from knitkit.types import PackedMicroBatch

# NOTE [ Reorganizer restart ]:
# A reorganizer that DIES (its process SIGKILLed or crashed in C, its Ray actor killed: gone
# without writing an error of its own) is restarted without restarting the job, at most
# ``Driver.Config.restart_reorganizers`` times over the job (0: the job fails, as before). One
# that FAILED (it wrote an error: a read failed, units are lost, a consumer died holding a slot)
# is not: a fresh one would fail the same way, so the job fails naming it.
# - Driver. ``RestartingPool`` wraps the pool; the scheduler thread's health check (the only
#   caller of ``check``, the same thread that submits) gets ``ReorganizerDied`` from the pool and
#   calls ``pool.replace(group)``: a fresh member on the group's ``successor_ring`` (same sizes,
#   name ``<name>_r<k>``), with every assignment the dead one had not PUBLISHED in full
#   re-submitted in order, from the store. What it published its ranks read from the dead ring
#   (below), so it is never served again. ``ProcessPool`` knows that exactly (its rings stay
#   mapped in the driver: the ring's published count against each assignment's end);
#   ``RayDispatcher`` re-submits every ``deliver`` whose return it has not seen (a superset: a
#   return can be lost with the actor).
# - Units. A re-submitted assignment is read from the store again, possibly after the group's
#   ranks ended the mini-batch (they had taken everything the dead member published). So the
#   driver frees a group's units of a mini-batch only once the group ended its last pass AND
#   ``pool.unpublished(group)`` no longer names the mini-batch: the same rule ("not published in
#   full") that decides re-submission, asked on the same scheduler thread, so a unit is never
#   freed while a member may still be handed its assignment again. ``JobCore.free_published``.
#   Freeing on the pass end alone raced: the successor failed with ``KeyError`` on a freed unit.
#   So frees lag the release a little (``drain`` returns on the release), and an assignment
#   re-served after a lost Ray return that no rank reads any more (the job's last one) keeps
#   its units until ``close``: its successor may still read them.
#   Nothing else in the driver changes: the schedule, the ledger and the other groups go on.
# - Ranks: nobody tells them; they need no message. A rank's consumer reads every micro-batch
#   the dead ring published (published slots stay readable while it is mapped), then, where it
#   would wait, sees the producer gone (``ReorganizerDiedError``) and attaches to the successor
#   ring (``FollowingConsumer``), polling for it for at most ``liveness_timeout_s``; then the
#   original error is raised. The successor serves whole assignments again, so the rank must
#   drop what it already took: every micro-batch carries its assignment's number (the pool's
#   ``tagged`` id) and its index, increasing along a group's stream; the consumer remembers the
#   last (number, index) it handed out and releases, unread, every re-served micro-batch at or
#   before it. So a pass interrupted at micro-batch i resumes at i + 1 on every rank of the group:
#   each TP rank took the same published micro-batches (all of them), so each drops the same ones
#   and their collectives still match; DP peers never notice (the schedule did not change).
#   Nothing is trained twice and nothing is skipped, also when the driver re-serves more than
#   needed (the Ray superset) or a rank reached the dead ring late (it finds the newest live
#   generation).
# - Bounds: the driver's restart budget; the rank's wait for a successor (``liveness_timeout_s``);
#   every other wait as before. A member that is alive but stuck (stale heartbeat) is not
#   restarted: its ranks raise ``ReorganizerDiedError`` once their wait for a successor ends.
# - A lost node (``NodeFailedError``): the whole job fails, so nothing is restarted once the pool
#   hears of it (``node_lost``, passed on to a ``NodeAware`` pool so that ``close`` waits for
#   nothing there); a member on a node the pool finds gone or unreachable is refused by its
#   ``replace`` (``RayDispatcher``): a fresh one there would never start.

RESTARTS_KEY = "knitkit/restart_reorganizers"
"""``RankSpec.extra`` key: how many restarts the driver allows (0 or absent: ranks never wait
for a successor ring)."""

ATTACH_POLL_S = 0.05
"""How often a rank looks for its group's successor ring."""


class RestartingPool:
    """A ``ReorganizerPool`` whose members that die are replaced, ``restarts`` times in all (see
    NOTE [ Reorganizer restart ]); everything else is the wrapped ``pool``'s."""

    def __init__(self, pool: ReorganizerPool, restarts: int) -> None:
        if restarts < 0:
            raise ValueError(f"restart_reorganizers={restarts} must be >= 0")
        self.pool = pool
        self.budget = restarts
        self.restarted: list[str] = []
        """Every group restarted so far, in order."""
        self.lost: list[str] = []
        """Nodes the job lost (``node_lost``): nothing is restarted any more."""

    @property
    def rings(self) -> Mapping[str, RingSpec]:
        return self.pool.rings

    def submit(self, name: str, minibatch_id: str, assignment: Assignment) -> None:
        self.pool.submit(name, minibatch_id, assignment)

    def check(self) -> None:
        """Replace every member that died (within the budget); raise for one that failed."""
        while True:
            try:
                self.pool.check()
                return
            except ReorganizerDied as died:
                if self.lost:
                    raise ReorganizerFailedError(
                        f"{died}; not restarted: the job lost node(s) {self.lost}; resume it "
                        "from its last checkpoint",
                        unreachable_node=died.unreachable_node,
                    ) from died
                if len(self.restarted) >= self.budget:
                    raise ReorganizerFailedError(
                        f"{died}; not restarted: {len(self.restarted)} of "
                        f"restart_reorganizers={self.budget} restarts used ({self.restarted})",
                        unreachable_node=died.unreachable_node,
                    ) from died
                self.pool.replace(died.group)
                self.restarted.append(died.group)

    def replace(self, name: str) -> RingSpec:
        return self.pool.replace(name)

    def unpublished(self, name: str) -> frozenset[str]:
        return self.pool.unpublished(name)

    def metrics(self) -> dict[str, float]:
        """The pool's figures and ``knitkit/job/reorganizer_restarts`` (cumulative)."""
        return {
            **self.pool.metrics(),
            "knitkit/job/reorganizer_restarts": float(len(self.restarted)),
        }

    def node_lost(self, node: str) -> None:
        """``NodeAware``: the job lost ``node``; the pool hears it (where it is ``NodeAware``: it
        waits for nothing there) and no member is restarted any more."""
        self.lost.append(node)
        if isinstance(self.pool, NodeAware):
            self.pool.node_lost(node)

    def close(self) -> None:
        self.pool.close()


def restarts_of(extra: Mapping[str, Any]) -> int:
    """The restart budget a driver put in its ``RankSpec.extra``."""
    return int(extra.get(RESTARTS_KEY, 0))


class FollowingConsumer:
    """A rank's consumer of its group's ring that follows the group's reorganizer to its
    successor rings, never handing out a micro-batch twice (see NOTE [ Reorganizer restart ]).

    Same use as ``MicroBatchConsumer`` for a rank: ``take(n)``, ``metrics()``, ``close()``.
    """

    def __init__(
        self,
        spec: RingSpec,
        index: int,
        *,
        restarts: int,
        liveness_timeout_s: float,
        wait_timeout_s: float,
    ) -> None:
        self._liveness_timeout_s, self._wait_timeout_s = liveness_timeout_s, wait_timeout_s
        self.consumer = self._attach(spec, index)
        self.spec, self.index = spec, index
        self.restarts = restarts
        self.generation = 0
        """How many successors this consumer moved through."""
        self.dropped = 0
        """Re-served micro-batches released unread (taken before the restart)."""
        self._last: tuple[int, int] | None = None
        """(assignment number, micro-batch index) of the last micro-batch handed out."""
        self._retired: list[MicroBatchConsumer] = []
        """Consumers of dead rings: kept mapped (their leases may still be read) until close."""

    @property
    def name(self) -> str:
        return self.consumer.name

    def take(self, count: int) -> Take:
        """Exactly the next ``count`` micro-batches, across restarts (``MicroBatchConsumer.take``)."""
        if count < 0:
            raise ValueError(f"take({count}): the count must be >= 0")
        return Take(self, count)

    def next_micro_batch(
        self, timeout_s: float | None = None, *, cancel: threading.Event
    ) -> PackedMicroBatch:
        """The next micro-batch not handed out before; moves to the successor ring when the
        reorganizer died (``StopIteration`` when the producer is done). With ``timeout_s``, a
        ring that publishes nothing new for that long raises ``TimeoutError`` (default: the
        consumer's ``wait_timeout_s``)."""
        while True:
            try:
                lease = self.consumer.next_micro_batch(timeout_s, cancel=cancel)
            except ReorganizerDiedError as died:
                if self.generation >= self.restarts:
                    raise
                self._follow(died, cancel)
                continue
            position = _position(lease)
            if position is not None and self._last is not None and position <= self._last:
                lease.release()  # re-served, already handed out: see NOTE [ Reorganizer restart ]
                self.dropped += 1
                continue
            self._last = position if position is not None else self._last
            return lease

    def wake(self) -> None:
        """Make a wait of ``next_micro_batch`` in another thread look at its cancel event."""
        self.consumer.wake()

    def metrics(self) -> dict[str, float]:
        """``MicroBatchConsumer.metrics`` summed over every ring it read, plus
        ``knitkit/delivery/reorganizer_moves`` and ``knitkit/delivery/re_served_dropped``."""
        figures = sum_over([c.metrics() for c in (*self._retired, self.consumer)])
        figures["knitkit/delivery/reorganizer_moves"] = float(self.generation)
        figures["knitkit/delivery/re_served_dropped"] = float(self.dropped)
        return figures

    def close(self) -> None:
        for consumer in (*self._retired, self.consumer):
            consumer.close()

    def _attach(self, spec: RingSpec, index: int) -> MicroBatchConsumer:
        return MicroBatchConsumer(
            spec,
            index,
            liveness_timeout_s=self._liveness_timeout_s,
            wait_timeout_s=self._wait_timeout_s,
        )

    def _follow(self, died: ReorganizerDiedError, cancel: threading.Event) -> None:
        """Attach to the newest live successor ring within ``liveness_timeout_s``, else raise."""
        deadline = time.monotonic() + self._liveness_timeout_s
        candidates = []
        spec = self.spec
        for _ in range(self.restarts - self.generation):
            spec = successor_ring(spec)
            candidates.append(spec)
        found = ""
        while True:
            for generation in range(len(candidates), 0, -1):
                spec = candidates[generation - 1]
                try:
                    consumer = self._attach(spec, self.index)
                except RingNotReadyError as missing:  # NOTE [ Ring role locks ] in slot_ring.py
                    found = str(missing)
                    continue
                self._retired.append(self.consumer)
                self.consumer, self.spec = consumer, spec
                self.generation += generation
                return
            if cancel.is_set():
                raise InterruptedError(f"the wait for ring {self.spec.name!r}'s successor ended")
            if time.monotonic() > deadline:
                raise ReorganizerDiedError(
                    f"{died}; no restarted reorganizer on {[c.name for c in candidates]} within "
                    f"liveness_timeout_s={self._liveness_timeout_s} ({found})"
                ) from died
            cancel.wait(ATTACH_POLL_S)


def _position(lease: PackedMicroBatch) -> tuple[int, int] | None:
    """(assignment number, micro-batch index) of a pool-tagged micro-batch, else ``None``."""
    extra = lease.layout.extra
    _, marker, number = str(extra.get("minibatch_id", "")).rpartition("@")
    if not marker or not number.isdigit():
        return None
    return int(number), int(extra["micro_batch"])
