"""The prefetch thread: pulls source items in order and stages each into its ring slot."""

from __future__ import annotations

import atexit
import collections
import itertools
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from knitkit.microbatch_iter.batch import field_tensors
from knitkit.microbatch_iter.exit_guard import exit_now
from knitkit.microbatch_iter.pool import StagingRing
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
# - Interpreter exit (with or without close()): an atexit hook sets ``stop`` on every live
#   thread and joins it for its join_timeout_s, so it finishes its current step and returns
#   before finalization. A thread still alive then (a long or stuck next(source), in torch or in
#   Python) would be killed mid-frame by finalization; the hook ends the process with the
#   training loop's own status instead: NOTE [ Exit with a thread inside the source ].

# NOTE [ Zero-copy hand-off ]
# On CPU, a packed item that stays valid until its release() (plan.view: a /dev/shm slot of a
# MicroBatchConsumer, say) is handed to the consumer as tensors over the published buffer itself,
# with no staging copy. Lifetime rule: the yielded tensors are valid until the consumer's next
# next() or close(), exactly as for a staging slot.
# - The Staged record carries the item's release. The consumer's next next() (or close())
#   retires the held record into ``retired`` (release_held); only retired records are released,
#   so no slot goes back to the producer while the consumer may still read it.
# - Retired records are released by the thread right after its next credit (off the consumer's
#   critical path: the release callback costs about as much as the rest of the hand-over), or
#   by the consumer itself when it finds ``ready`` empty, since the thread may then be blocked
#   in next(source) waiting for exactly those slots: a producer with fewer free slots than
#   ``depth + 1`` only limits how far ahead the thread gets; it never deadlocks.
#   ``release_lock`` serialises the callbacks (a MicroBatchConsumer's release is not
#   thread-safe); each record is taken from ``retired`` once, so it is released once.
# - Nothing is leaked: teardown (under ``lock``, after the thread stopped) releases the held
#   record, the retired ones and every record still queued in ``ready``.
# - The tensors view the producer's memory: the consumer must not write into them (the other TP
#   ranks of the group read the same slot); clone() what must be modified or kept longer.
# Items without a release (tuples, dicts) keep the staging copy. On CUDA, a released item whose
# slot is page-locked in place is copied to the device straight from the slot and handed back once
# that copy has finished (NOTE [ Registered source rings ], NOTE [ Stream/event hand-off ]); the
# prefetch thread waits for it while it is idle for a credit, or at the latest before its next pull.

_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class Staged:
    """A micro-batch staged into slot ``slot``, ready to hand over; ``slot`` is None when
    ``flat`` views the source's buffer (see NOTE [ Zero-copy hand-off ])."""

    index: int
    slot: int | None
    layout: MicroBatchLayout
    flat: torch.Tensor
    tensors: Mapping[str, torch.Tensor]
    """Field views over ``flat``, built here so the consumer's hand-over stays short."""
    fetch_s: float
    stage_s: float
    release: Callable[[], None] | None = None
    """Hands the source's buffer back; set when ``flat`` views it (NOTE [ Zero-copy hand-off ])."""


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
        ring: StagingRing,
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
        self.retired: queue.SimpleQueue[Staged] = queue.SimpleQueue()
        """Records the consumer moved past, still to release (NOTE [ Zero-copy hand-off ])."""
        self.copied: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        """(staging slot, release) of items copied to the device in place, whose source slot
        goes back once that copy finished (NOTE [ Registered source rings ])."""
        self.release_lock = threading.Lock()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.held: Staged | None = None
        """The micro-batch the consumer holds; written by the consumer thread (or teardown)."""
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
                self.release_retired()
                self.release_copied()  # the source may need these slots for the next item
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
                    # Queued under ``lock``: teardown drains (and releases) every record.
                    self.ready.put(self._stage(index, item, fetch_s=fetched - start))
                del item  # hold no view of the source's buffer while waiting
        except BaseException as error:
            self.ready.put(Failure(error))
        finally:
            if self._teardown_in_worker:
                self._teardown()

    def _acquire_credit(self) -> bool:
        if self.credits.acquire(blocking=False):
            return not self.stop.is_set()
        self.release_copied()  # idle until the consumer moves on: hand copied slots back now
        while not self.stop.is_set():
            if self.credits.acquire(timeout=_POLL_S):
                return True
        return False

    def _stage(self, index: int, item: SourceItem, *, fetch_s: float) -> Staged:
        start = time.perf_counter()
        plan = plan_staging(item)
        layout = plan.layout
        in_place = plan.view is not None and self.transport.reads_in_place(plan.view)
        if in_place and not self.transport.copies_to_device:
            # See NOTE [ Zero-copy hand-off ]: no copy, the record releases the item later.
            assert plan.view is not None
            flat = _tensor_over(plan.view)
            tensors = field_tensors(flat, layout, plan.torch_dtypes)
            stage_s = time.perf_counter() - start
            return Staged(index, None, layout, flat, tensors, fetch_s, stage_s, plan.release)
        slot = self.ring.slot_for(index)
        self.transport.before_refill(slot.index)
        self.ring.ensure(slot, layout.nbytes, host=not in_place)
        assert slot.device is not None
        if in_place:
            # The device copy reads the published slot itself, which goes back to the source once
            # that copy has finished (release_copied; NOTE [ Registered source rings ]).
            assert plan.view is not None and plan.release is not None
            source = _tensor_over(plan.view)
            self.transport.to_device(slot.index, source, slot.device, layout.nbytes)
            self.copied.append((slot.index, plan.release))
        else:
            assert slot.host is not None
            plan.copy_into(slot.host.numpy())
            _release(plan)
            self.transport.to_device(slot.index, slot.host, slot.device, layout.nbytes)
        flat = slot.device[: layout.nbytes]
        tensors = field_tensors(flat, layout, plan.torch_dtypes)
        stage_s = time.perf_counter() - start
        # The record keeps no reference to the source's buffer: its slot may be reused now.
        return Staged(index, slot.index, layout, flat, tensors, fetch_s, stage_s)

    def take(self, timeout_s: float) -> Staged | Failure | End:
        """Consumer side: the next record, in order; raises if the thread died without one, or
        ``TimeoutError`` after ``timeout_s`` (the source is slow or stuck)."""
        try:
            return self.ready.get_nowait()
        except queue.Empty:
            self.release_retired()  # the source may wait for these slots (NOTE [ Zero-copy hand-off ])
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.ready.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.thread.is_alive() and self.ready.empty():
                    raise RuntimeError("the prefetch thread exited without a result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no micro-batch from the source within next_timeout_s={timeout_s} s; "
                        "raise MicroBatchIterator.Config.next_timeout_s for a slower source"
                    ) from None

    def release_held(self) -> None:
        """Consumer side: the held micro-batch is done; recycle its staging slot, retire its
        source item (NOTE [ Zero-copy hand-off ])."""
        held, self.held = self.held, None
        if held is not None:
            if held.slot is not None:
                self.transport.release(held.slot)
            if held.release is not None:
                self.retired.put(held)

    def release_copied(self) -> None:
        """Hand back the source slots of in-place device copies, each once its copy finished
        (prefetch thread, or teardown; NOTE [ Registered source rings ])."""
        while True:
            try:
                slot, release = self.copied.popleft()
            except IndexError:
                return
            self.transport.wait_copy(slot)
            with self.release_lock:
                release()

    def release_retired(self) -> None:
        """Hand every retired source item back to the producer (either thread)."""
        with self.release_lock:
            while True:
                try:
                    record = self.retired.get_nowait()
                except queue.Empty:
                    return
                assert record.release is not None
                record.release()

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
            self.release_held()
            self.release_retired()
            self.release_copied()
            self.transport.close()
            self.ring.clear()
            while not self.ready.empty():  # staged records hold views of the slots
                record = self.ready.get_nowait()
                if isinstance(record, Staged) and record.release is not None:
                    record.release()  # see NOTE [ Zero-copy hand-off ]


class _Exposed:
    """``view``'s memory under the array interface, marked writable (keeps ``view`` alive)."""

    __slots__ = ("__array_interface__", "view")

    def __init__(self, view: np.ndarray) -> None:
        self.view = view
        interface = dict(view.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface


def _tensor_over(view: np.ndarray) -> torch.Tensor:
    """A tensor over ``view``'s bytes, no copy. torch has no read-only tensors (and warns on a
    read-only array), so a published slot's read-only view is exposed as is: the consumer must
    not write into it (other TP ranks read the same slot; NOTE [ Zero-copy hand-off ])."""
    if view.flags.writeable:
        return torch.from_numpy(view)
    return torch.from_numpy(np.asarray(_Exposed(view)))


def _release(plan: StagingPlan) -> None:
    if plan.release is not None:
        plan.release()


_LIVE: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


@atexit.register
def _stop_live_threads() -> None:
    """Stop every prefetch thread before interpreter finalization (see NOTE [ Prefetch thread
    shutdown ])."""
    live = list(_LIVE)
    for prefetcher in live:
        prefetcher.stop.set()
    for prefetcher in live:
        if prefetcher.thread.is_alive():
            prefetcher.thread.join(prefetcher.join_timeout_s)
    if any(prefetcher.thread.is_alive() for prefetcher in live):
        exit_now()
