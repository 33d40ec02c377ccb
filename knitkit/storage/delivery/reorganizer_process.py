"""Runs one reorganizer in its own spawned process; the launcher owns its slot ring and cleans up."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import FrameType

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.backends.segments import pid_alive
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer import Reorganizer
from knitkit.storage.delivery.slot_ring import (
    ConsumerDiedError,
    RingClosedError,
    RingSpec,
    SlotRing,
)
from knitkit.storage.planning.plan import ConsumerPlan, EncoderRankPlan

# NOTE [ Reorganizer process shutdown ]
#
# The launcher (this module's ReorganizerProcess, in the trainer or driver process) OWNS the ring:
# it creates it before spawning the child and unlinks it in close(). close() runs on every exit
# path: explicit close / `with`, an exception, SIGINT (KeyboardInterrupt), SIGTERM (turned into
# SystemExit while the launcher's SIGTERM handler is the default one) and interpreter exit
# (weakref.finalize). If the launcher is SIGKILLed, its resource tracker unlinks the ring.
# close(): set STOP (the child's loop and a producer blocked on a full ring give up), join for
# `join_timeout_s`, then terminate and finally kill the child, then unlink the ring.
# The child ignores SIGINT (the launcher decides), polls its assignment queue with a timeout and
# exits when STOP is set or the launcher's pid is gone, so it never outlives its owner for long.
# Whatever ends the child's loop is written to the ring (DONE or FAILED + traceback), so consumers
# raise instead of waiting; a killed child is caught by the consumers' liveness check. A consumer
# that died holding a slot ends the child's loop the same way (FAILED, naming the consumer).

_POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class Assignment:
    """One mini-batch's work for one reorganizer (a backbone (DP, CP) group or an encoder rank)."""

    minibatch_id: str
    plan: ConsumerPlan | EncoderRankPlan


class ReorganizerProcess:
    """A reorganizer in a spawned process, fed assignments in order; owns its slot ring."""

    def __init__(
        self, backend: UnitBackend, spec: RingSpec, *, join_timeout_s: float = 5.0
    ) -> None:
        """``backend`` must pickle into a reader of the same units (shared-memory or disk)."""
        _exit_on_sigterm()
        self.spec = spec
        self.join_timeout_s = join_timeout_s
        self.ring = SlotRing.create(spec)
        ctx = mp.get_context("spawn")
        self._assignments: mp.Queue[Assignment | None] = ctx.Queue()
        self._process = ctx.Process(
            target=_serve,
            args=(backend, spec, self._assignments),
            name=f"knitkit-reorganizer-{spec.name}",
            daemon=True,
        )
        self._finalizer = weakref.finalize(
            self, _shutdown, self.ring, self._process, self._assignments, join_timeout_s
        )
        try:
            self._process.start()
        except BaseException:
            self._finalizer()
            raise
        self.ring.set_producer_pid(self._process.pid or 0)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def bytes_read(self) -> int:
        """Payload bytes the child read from its backend so far."""
        return self.ring.bytes_read

    def submit(self, minibatch_id: str, plan: ConsumerPlan | EncoderRankPlan) -> None:
        """Queue one mini-batch's assignment; its micro-batches follow the previous ones'."""
        if not self._finalizer.alive:
            raise RuntimeError(f"reorganizer {self.spec.name!r} is closed; start a new one")
        self._assignments.put(Assignment(minibatch_id, plan))

    def finish(self, timeout_s: float = 60.0) -> bool:
        """No more assignments: the child publishes what it has, marks DONE and exits.

        Waits up to ``timeout_s`` for that (its consumers must read everything first); returns
        whether the child has exited. ``close()`` stops it either way.
        """
        self._assignments.put(None)
        self._process.join(timeout_s)
        return not self._process.is_alive()

    def close(self) -> None:
        """Stop the child (if still running) and unlink the ring; idempotent.

        See NOTE [ Reorganizer process shutdown ] for the order and every path that runs it.
        """
        self._finalizer()

    def __enter__(self) -> ReorganizerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shutdown(
    ring: SlotRing, process: BaseProcess, assignments: mp.Queue[Assignment | None], join_s: float
) -> None:
    ring.request_stop()
    if process.pid is not None:
        process.join(join_s)
        if process.is_alive():
            process.terminate()
            process.join(join_s)
        if process.is_alive():
            process.kill()
            process.join()
    assignments.close()
    assignments.cancel_join_thread()
    ring.close()
    ring.unlink()


def _serve(backend: UnitBackend, spec: RingSpec, assignments: mp.Queue[Assignment | None]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # see NOTE [ Reorganizer process shutdown ]
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    reorganizer = Reorganizer(backend, publisher)
    try:
        while True:
            try:
                item = assignments.get(timeout=_POLL_S)
            except queue.Empty:
                if publisher.ring.stop_requested or not pid_alive(publisher.ring.owner_pid):
                    raise RingClosedError(f"ring {spec.name!r} closed by its owner") from None
                continue
            if item is None:
                break
            with publisher.busy():  # NOTE [ Micro-batch publication protocol ]: liveness
                reorganizer.deliver(item.minibatch_id, item.plan)
        publisher.finish()
    except (RingClosedError, ConsumerDiedError) as exc:
        publisher.fail(str(exc))
    except BaseException:
        publisher.fail(f"reorganizer pid {os.getpid()} failed:\n{traceback.format_exc()}")
        raise
    finally:
        publisher.close()
        backend.close()


def _exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so ``finally`` blocks and finalizers unlink shared memory."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_system_exit)


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
