"""A reorganizer as a Ray actor: it owns its slot ring on its node and delivers assignments in order."""

from __future__ import annotations

import os
import threading
from typing import Any

import ray

from knitkit.storage import ConsumerPlan, EncoderRankPlan, RingSpec, UnitBackend
from knitkit.storage.delivery import ReorganizerHost

# NOTE [ Reorganizer actor lifetime ]
#
# Lifecycle table: docs/lifecycle.md.
# The actor is both the OWNER and the PRODUCER of its ring (see NOTE [ Micro-batch publication
# protocol ] in knitkit/storage/delivery/publication.py): its ReorganizerHost creates the
# /dev/shm segment on its node in __init__ and unlinks it in close(). Consumers are the group's
# TP ranks on the same node; they attach with `MicroBatchConsumer(spec, tp_rank)`.
# `deliver` calls run one after another in submission order (the default concurrency group has
# one thread), so mini-batches queue up behind each other. `stop`, `close` and the figures
# (`bytes_read`, `published`, `traffic`) run in a separate "control" group, so they get through while
# `deliver` waits on a full ring (a driver asks for figures under its lock while its ranks wait
# for it): `stop` sets the ring's STOP word and the blocked producer gives up; `close` also
# waits for a running `deliver` to return before it unmaps anything. A failing `deliver` writes
# FAILED and the reason to the ring before re-raising (ReorganizerHost), so consumers raise
# instead of waiting. If the actor process dies (node loss, `ray.kill`), consumers see its
# producer lock on the ring free (NOTE [ Ring role locks ] in knitkit/storage/delivery/slot_ring.py)
# within their liveness timeout and raise (or follow the actor a job's driver restarts on
# a successor ring: NOTE [ Reorganizer restart ] in knitkit/job/recovery.py); the segment is
# unlinked by the actor process's multiprocessing resource tracker.


@ray.remote(num_cpus=0, concurrency_groups={"control": 1})  # type: ignore[call-overload]
class ReorganizerActor:
    """One reorganizer (a backbone (DP, CP) group or an encoder rank) living in a Ray actor.

    Who creates, fills and unlinks its ring, and how it stops: see
    NOTE [ Reorganizer actor lifetime ].
    """

    def __init__(
        self, backend: UnitBackend, spec: RingSpec, liveness_timeout_s: float | None = None
    ) -> None:
        """``liveness_timeout_s``: its consumers' bound, which paces its idle heartbeat (NOTE
        [ Heartbeat period ] in knitkit/storage/delivery/publication.py)."""
        self.backend = backend
        self.spec = spec
        self.host = ReorganizerHost(
            backend, spec, owns_ring=True, liveness_timeout_s=liveness_timeout_s
        )
        self.closed = False
        self._delivering = threading.Lock()

    def where(self) -> tuple[str, int]:
        """(Ray node id, pid) of this actor: consumers must run on that node."""
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def niceness(self) -> int:
        """This actor's niceness (Ray's ``worker_niceness``: NOTE [ Ray workers at the
        trainer's priority ] in runtime.py)."""
        return os.nice(0)

    def deliver(self, minibatch_id: str, plan: ConsumerPlan | EncoderRankPlan) -> int:
        """Read, pack and publish every micro-batch of ``plan``; returns how many."""
        with self._delivering:
            if self.closed:
                raise RuntimeError(f"reorganizer of ring {self.spec.name!r} is closed")
            return self.host.deliver(minibatch_id, plan)

    def finish(self) -> None:
        """No more assignments: consumers stop after the last published micro-batch."""
        self.host.finish()

    @ray.method(concurrency_group="control")
    def bytes_read(self) -> int:
        """Read beside a ``deliver`` blocked on a full ring (a driver asks under its lock)."""
        return 0 if self.closed else self.host.bytes_read

    @ray.method(concurrency_group="control")
    def fill_s(self) -> float:
        """Thread CPU seconds spent writing micro-batches into slots (NOTE [ Fill time ] in
        knitkit/storage/delivery/reorganizer.py); read as ``bytes_read`` is."""
        return 0.0 if self.closed else self.host.fill_s

    @ray.method(concurrency_group="control")
    def traffic(self) -> dict[str, Any]:
        """Its backend's reads by source node (``RayBackend.traffic``); empty for a backend that
        does not count them, or once closed."""
        count = getattr(self.backend, "traffic", None)
        return {} if self.closed or count is None else dict(count())

    @ray.method(concurrency_group="control")
    def published(self) -> int:
        return 0 if self.closed else self.host.published

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        """Make a ``deliver`` blocked on a full ring give up (consumers then raise)."""
        self.host.stop()

    @ray.method(concurrency_group="control")
    def close(self) -> None:
        """Stop producing, unlink the ring and close the backend; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.host.stop()
        with self._delivering:  # a deliver returns after its assignment, or at once if blocked
            self.host.close()
            self.backend.close()
