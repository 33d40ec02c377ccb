"""The prefetch thread: pulls source items in order and stages each into its ring slot."""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from knitkit.microbatch_iter.batch import field_tensors
from knitkit.microbatch_iter.pool import SlotRing
from knitkit.microbatch_iter.source import SourceItem, StagingPlan, plan_staging
from knitkit.microbatch_iter.transport import Transport
from knitkit.types import MicroBatchLayout

# NOTE [ Prefetch thread shutdown ]
# One daemon thread per iterator. It shares only this Prefetcher with the consumer, never the
# iterator itself, so dropping the last reference to the iterator runs its weakref finalizer
# (= shutdown()) while the thread is still running.
# - Bounded memory: ``credits`` (a BoundedSemaphore of ``depth``) is taken before each pull from
#   the source and returned when the consumer has launched the micro-batch it holds. At most
#   ``depth`` micro-batches are pulled ahead of the one the consumer holds, so ``depth + 1``
#   slots suffice and the source is never read further ahead.
# - Every blocking call of the thread that we own has a timeout (credits.acquire) or is bounded
#   (copies, event waits); ``ready`` is unbounded, so put() never blocks. The thread checks
#   ``stop`` after every blocking step and exits; an item pulled after ``stop`` is released.
# - Results travel in order through ``ready``: Staged records, then one End or Failure. The
#   consumer polls with a timeout and gives up if the thread died without a final record.
# - shutdown() (close(), the context manager, GC, end of data, error): set ``stop``, join with
#   ``join_timeout_s``, then under ``lock`` release the held slot and tear the ring down. The
#   thread stages only under ``lock`` and after re-checking ``stop``, so teardown never races a
#   copy. A source blocked in next() cannot be interrupted: after the timeout the thread is left
#   running (it is a daemon and never blocks interpreter exit) and a warning names the cause.
#   The source's close() is called only once the thread has exited (a generator cannot be
#   closed while it runs). shutdown() is idempotent and does nothing at interpreter exit.
# - Interpreter exit without close(): an atexit hook sets ``stop`` on every live thread and joins
#   it briefly. A daemon thread still inside torch's C++ code when the interpreter finalizes is
#   killed mid-frame, which aborts the process ("terminate called without an active exception");
#   stopped threads finish their current step and return first. A thread blocked in the
#   source's next() (pure Python) is left to die with the process as before.

_POLL_S = 0.1
_EXIT_JOIN_S = 1.0


@dataclass(frozen=True, slots=True)
class Staged:
    """A micro-batch staged into slot ``slot`` and ready to hand over."""

    index: int
    slot: int
    layout: MicroBatchLayout
    flat: torch.Tensor
    tensors: Mapping[str, torch.Tensor]
    """Field views over ``flat``, built here so the consumer's hand-over stays short."""
    fetch_s: float
    stage_s: float


@dataclass(frozen=True, slots=True)
class Failure:
    """The exception that ended the thread, raised again in the consumer."""

    error: BaseException


class End:
    """The source is exhausted."""


class Prefetcher:
    """State shared by the consumer and the prefetch thread; see NOTE [ Prefetch thread shutdown ]."""

    _ids = itertools.count()

    def __init__(
        self,
        source: Iterator[SourceItem],
        ring: SlotRing,
        transport: Transport,
        *,
        depth: int,
        join_timeout_s: float,
    ) -> None:
        self.source = source
        self.ring = ring
        self.transport = transport
        self.join_timeout_s = join_timeout_s
        self.credits = threading.BoundedSemaphore(depth)
        self.ready: queue.SimpleQueue[Staged | Failure | End] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.held: int | None = None
        """Slot of the micro-batch the consumer holds; written by the consumer thread only."""
        self._closed = False
        self._torn_down = False
        self._teardown_in_worker = False
        name = f"knitkit-microbatch-prefetch-{next(self._ids)}"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        _LIVE.add(self)

    def _run(self) -> None:
        try:
            self.transport.enter_worker()
            for index in itertools.count():
                if not self._acquire_credit():
                    return
                start = time.perf_counter()
                try:
                    item = next(self.source)
                except StopIteration:
                    self.ready.put(End())
                    return
                fetched = time.perf_counter()
                with self.lock:
                    if self.stop.is_set():
                        _release(plan_staging(item))
                        return
                    staged = self._stage(index, item, fetch_s=fetched - start)
                del item  # the source's buffer is released; hold no view of it while waiting
                self.ready.put(staged)
        except BaseException as error:
            self.ready.put(Failure(error))
        finally:
            if self._teardown_in_worker:
                self._teardown()

    def _acquire_credit(self) -> bool:
        while not self.stop.is_set():
            if self.credits.acquire(timeout=_POLL_S):
                return True
        return False

    def _stage(self, index: int, item: SourceItem, *, fetch_s: float) -> Staged:
        start = time.perf_counter()
        plan = plan_staging(item)
        slot = self.ring.slot_for(index)
        self.transport.before_refill(slot.index)
        self.ring.ensure(slot, plan.layout.nbytes)
        assert slot.host is not None and slot.device is not None
        plan.copy_into(slot.host.numpy())
        _release(plan)
        layout = plan.layout
        self.transport.to_device(slot.index, slot.host, slot.device, layout.nbytes)
        flat = slot.device[: layout.nbytes]
        tensors = field_tensors(flat, layout, plan.torch_dtypes)
        stage_s = time.perf_counter() - start
        # The record keeps no reference to the source's buffer: its slot may be reused now.
        return Staged(index, slot.index, layout, flat, tensors, fetch_s, stage_s)

    def take(self) -> Staged | Failure | End:
        """Consumer side: the next record, in order; raises if the thread died without one."""
        while True:
            try:
                return self.ready.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.thread.is_alive() and self.ready.empty():
                    raise RuntimeError("the prefetch thread exited without a result") from None

    def shutdown(self) -> None:
        """Stop the thread and free the ring; idempotent. See NOTE [ Prefetch thread shutdown ]."""
        if self._closed:
            return
        self._closed = True
        if threading.current_thread() is self.thread:
            # GC ran the finalizer inside the thread, which may hold ``lock``: let it tear down.
            self._teardown_in_worker = True
            self.stop.set()
            return
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(self.join_timeout_s)
        self._teardown()
        if self.thread.is_alive():
            warnings.warn(
                f"{self.thread.name} is still inside next(source) {self.join_timeout_s}s after "
                "close(); it is a daemon thread and exits with the process; make the source's "
                "next() return (or time out) to stop it sooner",
                ResourceWarning,
                stacklevel=2,
            )
        else:
            close = getattr(self.source, "close", None)
            if callable(close):
                close()

    def _teardown(self) -> None:
        with self.lock:
            if self._torn_down:
                return
            self._torn_down = True
            if self.held is not None:
                self.transport.release(self.held)
                self.held = None
            self.transport.close()
            self.ring.clear()
            while not self.ready.empty():  # staged records hold views of the slots
                self.ready.get_nowait()


def _release(plan: StagingPlan) -> None:
    if plan.release is not None:
        plan.release()


_LIVE: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


@atexit.register
def _stop_live_threads() -> None:
    """Stop every prefetch thread before interpreter finalization (see NOTE above)."""
    live = list(_LIVE)
    for prefetcher in live:
        prefetcher.stop.set()
    for prefetcher in live:
        if prefetcher.thread.is_alive():
            prefetcher.thread.join(min(prefetcher.join_timeout_s, _EXIT_JOIN_S))
