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
from types import MappingProxyType

import numpy as np
import torch

from knitkit.microbatch_iter.batch import MicroBatch, ViewCache, build_micro_batch
from knitkit.microbatch_iter.exit_guard import abandon, exit_now
from knitkit.microbatch_iter.pool import StagingRing
from knitkit.microbatch_iter.source import (
    LeasesInline,
    SourceItem,
    StagingPlan,
    check_layout,
    plan_staging,
)
from knitkit.microbatch_iter.transport import Transport
from knitkit.types import MicroBatchLayout, PackedMicroBatch

# NOTE [ Prefetch thread shutdown ]
# Lifecycle table: docs/lifecycle.md.
# One daemon thread per iterator (or a reused one: NOTE [ One prefetch thread per rank ]), the
# rank's only prefetch mechanism: it pulls the source (for a
# MicroBatchConsumer: waits for the publication, decodes the layout, maps the slot) and stages
# what it pulled, during the training loop's compute. It shares only this Prefetcher with the
# consumer, never the iterator itself, so dropping the last reference to the iterator runs its
# weakref finalizer (= shutdown()) while the thread is still running.
# - Bounded memory: ``credits`` (tokens in a SimpleQueue: a semaphore in C, whose release costs
#   ~0.1 us and a wake ~2.5 us, against ~4 and ~6 us for threading.Semaphore's Condition in
#   Python: a scratch timing on the 2-core dev box at load 12-15, issue 31; each token is worth
#   a count of credits) is taken before each pull from the source and returned when the
#   consumer has launched the micro-batch it holds, ``refill`` at a time (NOTE [ Refills in
#   batches ] in iterator.py). At most ``depth + refill - 1`` micro-batches are pulled ahead of
#   the one the consumer holds, so ``depth + refill`` slots suffice and the source is never
#   read further ahead (a bounded source, such as a consumer's ``take(n)``, is never asked for
#   item n + 1).
# - Every blocking call of the thread that we own has a timeout (credits.get) or is bounded
#   (copies, event waits); ``ready`` is unbounded, so put() never blocks. The thread checks
#   ``stop`` after every blocking step and exits; an item pulled after ``stop`` is released.
#   ``request_stop`` sets ``stop`` and puts one more credit, so a thread waiting for a credit
#   wakes at once: that wait can sleep in long slices (a wake costs ~0.1 ms of CPU, issue 23).
# - Results travel in order through ``ready``: Staged records, then one End or Failure. The
#   consumer blocks on it in slices and gives up if the thread died without a final record.
# - shutdown() (close(), the context manager, GC, end of data, error): set ``stop``, interrupt
#   the source (its ``interrupt()``, if it has one: a consumer's wait then ends at once), join
#   with ``join_timeout_s``, then under ``lock`` release the held item and tear the ring down.
#   The thread stages only under ``lock`` and after re-checking ``stop``, so teardown never races
#   a copy. A source without ``interrupt()`` blocked in next() cannot be interrupted: after the
#   timeout the thread is left running (a daemon) and a warning names the cause. The source's
#   close() is called only once the thread has exited (a generator cannot be closed while it
#   runs). shutdown() is idempotent and does nothing at interpreter exit.
# - Interpreter exit (with or without close()): an atexit hook sets ``stop`` on every live
#   thread, interrupts each source, raises ``SourceAbandoned`` asynchronously in a thread that is
#   inside a source without ``interrupt()`` (it lands as soon as the thread runs Python again:
#   between two torch ops of a collate), and joins each for its join_timeout_s, so threads return
#   before finalization and the interpreter exits normally: every atexit handler runs and the
#   status is the loop's (NOTE [ Exit with a thread inside the source ]).
# Who sees errors: a source or staging error ends the thread with a Failure record; the training
# loop's next next() raises it (the original exception, with its traceback).

# NOTE [ Zero-copy hand-off ]
# On CPU, a lease that offers a private view (``PackedMicroBatch.private``: a MicroBatchConsumer's
# copy-on-write mapping of its ring's slots) is handed to the training loop as tensors over that
# view, with no staging copy. Lifetime rule: the yielded tensors are valid until the consumer's
# next next() or close(), exactly as for a staging slot.
# - One copy per delivered byte (issue 31): the reorganizer packs into the ring slot, and the
#   rank's tensors ARE that slot: no copy on the rank. Each consumer maps its ring's data region
#   ONCE (one MAP_PRIVATE mapping per ring and process, for the whole job) and keeps every slot's
#   pages mapped across occupants: the prefetch thread faults a slot's pages in once, all of
#   them (MADV_POPULATE_READ, the first time the slot is used), so neither the loop nor later
#   hand-outs take page faults or change page tables.
# - Why copy-on-write and not a read-only mapping: torch has no read-only tensors, and the TP
#   peers of a rank read the same slot. Over a PROT_READ mapping a rank's in-place write (masking
#   loss_mask, clamp_ on tokens: common in RL losses) kills the rank with SIGSEGV and no Python
#   traceback; over a shared writable mapping it silently changes the peers' micro-batch. With
#   MAP_PRIVATE, a page the rank never writes IS the shared page (reads see each new occupant),
#   and a write copies that page for this process only: the write works, the peers never see it.
#   No API change, no ``writable=True`` copy to ask for; ``clone()`` is still the way to keep a
#   tensor past the lease.
# - The release undoes writes only where there were some: unless the process took no page fault
#   since the slot was last clean (then nothing can have been written: NOTE [ Written pages only
#   after a fault ] in slot_ring.py), it reads this process's page map for
#   the lease's range (/proc/self/pagemap, one pread of 8 bytes per page: a written page is
#   anonymous, an unwritten one is still the file's; ``written_pages.py``) and drops the private
#   copies of the written span (MADV_DONTNEED) BEFORE it stores its release, so the slot's next
#   occupant is read from the shared pages again. Where the page map cannot be read, the whole
#   range is dropped (the earlier behaviour). Costs, per 2.3 MiB micro-batch of transfer.py's
#   fields (one consumer, thread CPU medians, 2-core dev box, issue 31): hand-out 49 us (wait
#   check, layout decode, lease), staging 34 us (views), release 68 us (the page-map read: it
#   touches every page's struct page, 25-65 us) = ~150 us, against 58 + 196 (populate per
#   hand-out) + 56 (drop) = ~310 us before; issue 31 measured the earlier copy-on-write hand-off
#   at 143 us/MiB against 43 us/MiB for a plain copy. Inside transfer.py's knitkit phases (8
#   ranks and 6 reorganizers on 2 cores, load 4-11, warm-up steps included; per-function thread
#   CPU, RANK31's scratch profile at 7290235) the same steps cost about 3x that per micro-batch:
#   hand-out 383 us (wait 125, decode 90, per-phase first mapping 74, size checks 25), views
#   152, release 84 (the page map read at 282 of 720 releases, a wake at 299), the loop's
#   next() 70: cache misses after compute and contention, not one dominant step.
# - Where the hand-out runs: on the loop's thread, inside next(), for a source that hands out
#   leases inline (NOTE [ Inline hand-out ]); on the prefetch thread for every other source.
# - The Staged record carries the lease's release. The consumer's next next() (or close())
#   retires the held record into ``retired`` (release_held); only retired records are released,
#   so no slot goes back to the producer while the consumer may still read it.
# - Retired records are released by the thread right before its next pull (off the consumer's
#   critical path), unless the thread is already inside next(source) (``in_source``), where it
#   may wait for exactly those slots: then the consumer releases them itself. The thread sets
#   ``in_source`` before it drains ``retired``; the consumer puts into ``retired`` before it reads
#   ``in_source``: (under the GIL, in that order) one of the two sees the other's step, so a
#   retired record is never left behind while the thread waits for its slot.
#   ``release_lock`` serialises the callbacks (a source's release need not be thread-safe); each
#   record is taken from ``retired`` once, so each lease is released once.
# - Nothing is leaked: teardown (under ``lock``, after the thread stopped) releases the held
#   record, the retired ones and every record still queued in ``ready``.
# Leases without a private view (a producer's shared buffer, tuples, dicts) get the staging copy
# and are released right after it. On CUDA, a released item whose slot is page-locked in place is
# copied to the device straight from the slot and handed back once that copy has finished (NOTE
# [ Registered source rings ], NOTE [ Stream/event hand-off ]); the prefetch thread waits for it
# while it is idle for a credit, or at the latest before its next pull.

# NOTE [ Inline hand-out ]
# On CPU, a source that hands out zero-copy leases from a ring its producer packs ahead
# (``LeasesInline``: a MicroBatchConsumer and its take(); not a take that overrides __next__,
# such as a job's checked one) gets no prefetch thread: next() releases the held lease and takes
# the next one on the loop's own thread (Prefetcher.hand_out), waiting on the ring's futex only
# if it is not published yet. The look-ahead is the ring's: the producer packs as many slots ahead
# as the ring has free, at least the iterator's depth + 1 minus the one the loop holds. A
# prefetch thread added per micro-batch a credit wait and a publication wait (two sleeps and
# wakes, each ~50-110 us of CPU on a loaded machine), two queue hand-overs and GIL hand-offs with
# the loop, for work (decode ~85 us, views ~130, release ~80) that costs the same on either
# thread: both run it right after the loop's compute, with cold caches. What it costs: that
# work now runs inside next(), on the loop's critical path, so ``exposed_s_per_step`` rises by it
# while the CPU falls (where a rank's cores are shared with compute, the CPU is what the step
# waits for). Leases, release order, close()/interrupt from another thread, the exit hook, errors
# and next_timeout_s behave as with the thread (tests/microbatch_iter/test_leases.py).
# Measured (issue 31, transfer.py --quick, knitkit phases, 8 ranks on the 2-core dev box, load
# 7-16; per-thread schedstat of each rank, compute excluded, per micro-batch; b870bfe -> this):
# look-ahead 1 824 -> 519 us (prefetch thread 590 + loop 234 -> loop 519), look-ahead 2 800 ->
# 525, eager 493 -> 405; sleeps of the rank's threads 3.1 -> 0.5 (look-ahead), 3.5 -> 1.3
# (eager); thread starts 1 -> 0 per iterator; calls per hand-out 144-146 -> 130-131
# (tests/storage/test_handout_calls.py); the figure, old then new back to back (load 9-25):
# ``knitkit.cpu_s_per_step.ranks`` 0.0332 -> 0.0280, 0.0333 -> 0.0244 (0.0388 -> 0.0258
# instrumented), while the look-ahead exposed waits swung with the load (0.006-0.032 ->
# 0.010-0.060 s per step). ``Config(hand_out_inline=False)`` keeps the thread.
# (At 62f8166, before the futex waits and the cuts in decode and views, a scratch driver had
# found the same CPU on either thread.)

# NOTE [ Slot tensors kept ]
# An inline hand-out (NOTE [ Inline hand-out ]) takes leases whose private view is the first
# bytes of its slot's own exporter (``LeasesInline``; NOTE [ One exporter per slot ] in
# knitkit/storage/delivery/consumer.py), so the slot is known by that object: its first hand-out
# makes one flat tensor over the whole slot, and its ``ViewCache`` keeps that tensor's dtype views
# for every later occupant, whatever its size. Each hand-out then cuts the micro-batch's flat
# tensor and field views from them, with no ``torch.frombuffer`` and no dtype views made again
# when a micro-batch is larger than the slot's last one (packed token counts vary: every other
# one of transfer.py's was). Right after compute, the first torch call of a hand-out costs
# ~30 us and each later one ~5 (thread time, 2-core dev box, issue 31).

# NOTE [ Micro-batches built ahead ]
# With a prefetch thread, the thread builds each micro-batch's ``MicroBatch`` and its stats when it
# queues the record (``Staged.batch``); ``next()`` only sets the stats' ``wait_s``, once known,
# and adds them to the totals (``IterStats.handed``). Right after a step's compute every object
# the loop's thread builds or touches costs cache misses, so building two objects there (two
# frames, two ``object.__new__``, ten slot stores) cost more than their calls suggest: 12 -> 8
# calls per hand-over (tests/microbatch_iter/test_handover_calls.py); prefetch.py's hand-over
# (8 interleaved pairs, 3 repeats each, load 6-11, issue 31), medians: the loop thread's CPU in
# next() 56.9 -> 47.1 us per micro-batch (lower in 7 of 8 pairs), wall 76.0 -> 68.0. A ``convert``
# run ahead gets that ``MicroBatch`` (its ``wait_s`` stays 0, as before); an inline hand-out
# (NOTE [ Inline hand-out ]) builds it inside ``next()``, where it runs on the loop's thread
# either way.

_NO_OVERRIDES: Mapping[str, torch.dtype] = MappingProxyType({})
"""A lease's fields keep their layout dtypes."""
_NO_BYTES = torch.empty(0, dtype=torch.uint8)
"""The flat tensor of an empty lease (``torch.frombuffer`` refuses an empty buffer)."""
_PRIVATE_VIEW_SLOTS = 64
"""Private slot views whose field views are kept (a ring has a few slots; a source whose
private views are fresh buffers each time would otherwise pin them all)."""
_ANNOUNCED_WAIT_S = 2.0
"""Slice of a wait whose end is always announced: the thread's wait for a credit (``next()`` or
``request_stop`` puts one), the consumer's wait for a record (the thread puts one before it
exits); the slice only bounds a missed one. Each slice that ends is a wake with nothing to do
(~0.1-0.2 ms of CPU under load, issue 31): the consumer's polled every 0.1 s before."""


@dataclass(
    slots=True
)  # not frozen: built per micro-batch (NOTE [ Hand-out objects without __init__ ])
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
    """Releases the lease ``flat`` views (NOTE [ Zero-copy hand-off ])."""
    converted: object = None
    """What the iterator's ``convert`` made of it (NOTE [ Conversion on the prefetch thread ])."""
    batch: MicroBatch | None = None
    """The ``MicroBatch`` the loop is handed, built by the prefetch thread (NOTE [ Micro-batches
    built ahead ]); None where the loop builds it (an inline hand-out)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """The exception that ended the thread, raised again in the consumer."""

    error: BaseException


class End:
    """The source is exhausted."""


class Prefetcher:
    """State shared by the consumer and the prefetch thread; see NOTE [ Prefetch thread shutdown ]."""

    def __init__(
        self,
        source: Iterator[SourceItem],
        ring: StagingRing,
        transport: Transport,
        *,
        depth: int,
        refill: int = 1,
        join_timeout_s: float,
        exit_on_stuck_source: bool = False,
        convert: Callable[[Staged], Staged] | None = None,
        threads: PrefetchThreads | None = None,
    ) -> None:
        self.source = source
        self.convert = convert
        """Run on each staged record before it is queued (NOTE [ Conversion on the prefetch
        thread ] in iterator.py)."""
        self.ring = ring
        self.transport = transport
        self.join_timeout_s = join_timeout_s
        self.exit_on_stuck_source = exit_on_stuck_source
        self.credits: queue.SimpleQueue[int] = queue.SimpleQueue()
        """Tokens, each the number of micro-batches the thread may pull ahead on it (NOTE
        [ Prefetch thread shutdown ], NOTE [ Refills in batches ] in iterator.py)."""
        self.credits.put(depth + refill - 1)
        self._credits_left = 0
        """Of the token the thread took last, the pulls it still allows (the thread's own)."""
        self.refill = refill
        """Credits the consumer returns in one token: the thread is woken once per ``refill``
        micro-batches (NOTE [ Refills in batches ] in iterator.py)."""
        self.owed = 0
        """Credits the consumer has earned back but not returned yet (< ``refill``; its own)."""
        self.ready: queue.SimpleQueue[Staged | Failure | End] = queue.SimpleQueue()
        self.retired: queue.SimpleQueue[Staged] = queue.SimpleQueue()
        """Records the consumer moved past, still to release (NOTE [ Zero-copy hand-off ])."""
        self.copied: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        """(staging slot, release) of items copied to the device in place, whose source slot
        goes back once that copy finished (NOTE [ Registered source rings ])."""
        self.release_lock = threading.Lock()
        self._private_views: dict[int, ViewCache] = {}
        """Field views over the private views of a source's slots, by address (NOTE [ Reused
        field views ]); cleared at teardown, before the source is closed."""
        self._slots: dict[int, tuple[object, torch.Tensor, ViewCache]] = {}
        """id of a slot's exporter -> it, a flat tensor over it, its views (NOTE [ Slot tensors
        kept ]); cleared at teardown, before the source is closed."""
        self.stop = False
        """Set once by ``request_stop`` (a plain flag, read per micro-batch without a call: an
        Event's ``is_set`` is a Python frame, and nothing waits on it)."""
        self.lock = threading.Lock()
        self.in_source = False
        """True while the thread is inside next(source) (NOTE [ Zero-copy hand-off ])."""
        self.held: Staged | None = None
        """The micro-batch the consumer holds; written by the consumer thread (or teardown)."""
        self._closed = False
        self._torn_down = False
        self._teardown_in_worker = False
        self._threads = threads
        self.done = threading.Event()
        """Set when ``_run`` returned: the prefetch has ended, whether its thread lives on
        (``PrefetchThreads``) or not."""
        self.thread = threading.Thread(target=self._run, name=_thread_name(), daemon=True)
        """The thread that runs (or will run) ``_run``: a reused one once ``start()`` took
        one from ``threads``."""
        _LIVE.add(self)

    def start(self) -> None:
        """Run the prefetch on a thread of ``threads`` (NOTE [ One prefetch thread per rank ]),
        else on this Prefetcher's own."""
        if self._threads is None or not self._threads.run(self):
            self.thread.start()

    def alive(self) -> bool:
        """Whether the prefetch is running (started and ``_run`` not returned)."""
        return self.thread.is_alive() and not self.done.is_set()

    def _run(self) -> None:
        try:
            self._prefetch()
        finally:
            self.done.set()

    def _prefetch(self) -> None:
        try:
            self.transport.enter_worker()
            for index in itertools.count():
                if not self._acquire_credit():
                    return
                self.in_source = True  # before draining: see NOTE [ Zero-copy hand-off ]
                try:
                    self.release_retired()
                    if self.copied:  # the source may need these slots for the next item
                        self.release_copied()
                    start = time.perf_counter()
                    item = next(self.source)
                except StopIteration:
                    self.ready.put(End())
                    return
                finally:
                    self.in_source = False
                fetched = time.perf_counter()
                with self.lock:
                    record = self._stage_unless_stopped(index, item, start, fetched)
                    if record is None:
                        return
                    # Queued under ``lock``: teardown drains (and releases) every record.
                    record.batch = build_micro_batch(record, 0.0)  # the wait: set at hand-over
                    if self.convert is not None:
                        record = self.convert(record)
                    self.ready.put(record)
                del item, record  # hold no view of the source's buffer while waiting
        except BaseException as error:
            self.ready.put(Failure(error))
        finally:
            if self._teardown_in_worker:
                self._teardown()

    def _acquire_credit(self) -> bool:
        if self._credits_left:
            self._credits_left -= 1
            return not self.stop
        if not self.credits.empty():
            # only this thread takes credits: one is there
            self._credits_left = self.credits.get_nowait() - 1
            return not self.stop
        self.release_copied()  # idle until the consumer moves on: hand copied slots back now
        while not self.stop:
            try:
                self._credits_left = self.credits.get(timeout=_ANNOUNCED_WAIT_S) - 1
            except queue.Empty:
                continue
            return not self.stop
        return False

    def return_credit(self) -> None:
        """Consumer side: the held micro-batch is launched, the thread may stage one more;
        returned to it ``refill`` at a time (NOTE [ Refills in batches ] in iterator.py; the
        iterator's ``next()`` runs the same steps inline)."""
        self.owed += 1
        if self.owed == self.refill:
            self.credits.put(self.owed)
            self.owed = 0

    def request_stop(self) -> None:
        """Set ``stop`` and wake a thread waiting for a credit (NOTE [ Prefetch thread shutdown ])."""
        self.stop = True
        self.credits.put(1)

    def _stage(self, index: int, item: SourceItem, start: float, *, fetch_s: float) -> Staged:
        """``item`` staged, from ``start`` (``perf_counter()`` when it was fetched)."""
        if (
            isinstance(item, PackedMicroBatch)
            and item.private is not None
            and not self.transport.copies_to_device
        ):
            return self._zero_copy(index, item, start, fetch_s, slots=False)
        plan = plan_staging(item)
        layout = plan.layout
        overrides = plan.torch_dtypes
        in_place = plan.view is not None and self.transport.reads_in_place(plan.view)
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
            assert slot.host is not None and slot.array is not None
            plan.copy_into(slot.array)
            _release(plan)
            self.transport.to_device(slot.index, slot.host, slot.device, layout.nbytes)
        cached = slot.views.get(layout, overrides)  # see NOTE [ Reused field views ]
        if cached is None:
            cached = slot.views.put(slot.device, layout, overrides)
        stage_s = time.perf_counter() - start
        # The record keeps no reference to the source's buffer: its slot may be reused now.
        return Staged(index, slot.index, layout, *cached, fetch_s, stage_s)

    def _zero_copy(
        self, index: int, item: PackedMicroBatch, start: float, fetch_s: float, *, slots: bool
    ) -> Staged:
        """``item``, a lease with a private view, staged with no copy (NOTE [ Zero-copy
        hand-off ]): the record releases the lease later; from ``start`` as ``_stage``'s;
        ``slots``: its private view starts at its exporter's first byte (NOTE [ Slot tensors
        kept ])."""
        # private() is the lease's own view (a source may book it for the release's drop of
        # written pages): ask every lease, cached views or not (NOTE [ Reused field views ]);
        # only its address (or its slot's exporter) picks the cached views.
        layout = item.layout
        private = item.private()  # type: ignore[misc]
        if slots and layout.nbytes:
            exporter = private.obj  # type: ignore[union-attr]
            kept = self._slots.get(id(exporter))
            if kept is None or kept[0] is not exporter:
                kept = self._slot_tensors(exporter)
            _, base, views = kept
        else:
            # one torch call over the buffer (np.frombuffer, its address and from_numpy: 4x)
            base = torch.frombuffer(private, dtype=torch.uint8) if layout.nbytes else _NO_BYTES
            views = self._views_at(base.data_ptr())
        # cached views were put for an equal layout, which passed check_layout then
        cached = views.get(layout, _NO_OVERRIDES)
        if cached is None:
            check_layout(layout)
            cached = views.put(base, layout, _NO_OVERRIDES)
        stage_s = time.perf_counter() - start
        return Staged(index, None, layout, *cached, fetch_s, stage_s, item.release)

    def _views_at(self, address: int) -> ViewCache:
        """The cached views of the private view at ``address`` (NOTE [ Reused field views ])."""
        views = self._private_views.get(address)
        if views is None:
            if len(self._private_views) >= _PRIVATE_VIEW_SLOTS:
                self._private_views.clear()  # not a ring's few slots: bound what is held
            views = self._private_views[address] = ViewCache()
        return views

    def _slot_tensors(self, exporter: object) -> tuple[object, torch.Tensor, ViewCache]:
        """A slot's ``exporter`` (of its leases' private views), a flat tensor over the whole
        slot and the slot's cached views, made at the slot's first hand-out and kept (NOTE
        [ Slot tensors kept ])."""
        if len(self._slots) >= _PRIVATE_VIEW_SLOTS:
            self._slots.clear()  # not a ring's few slots: bound what is held
        whole = torch.frombuffer(exporter, dtype=torch.uint8)
        kept = self._slots[id(exporter)] = (exporter, whole, ViewCache())
        return kept

    def hand_out(self, index: int, source: LeasesInline, timeout_s: float) -> Staged | None:
        """Consumer side, with no prefetch thread (NOTE [ Inline hand-out ]): release the held
        micro-batch, take the next lease on this thread (waiting at most ``timeout_s``) and stage
        it as the held one; None at the end of the source or once stopped."""
        with self.lock:
            held, self.held = self.held, None
            if held is not None and held.release is not None:
                held.release()
        self.in_source = True  # the exit hook interrupts a wait (NOTE [ Prefetch thread shutdown ])
        start = time.perf_counter()
        try:
            item = source.next_lease(timeout_s)
        except StopIteration:
            return None
        except InterruptedError:
            if self.stop:  # close() from another thread interrupted the wait
                return None
            raise
        finally:
            self.in_source = False
        fetched = time.perf_counter()
        with self.lock:
            if self.stop:  # the teardown may already have run
                item.release()
                return None
            if item.private is None:  # a lease to copy after all
                record = self._stage(index, item, fetched, fetch_s=fetched - start)
            else:  # the usual case, one frame (NOTE [ Lease in few calls ] in consumer.py)
                record = self._zero_copy(index, item, fetched, fetched - start, slots=True)
            self.held = record
        return record

    def _stage_unless_stopped(
        self, index: int, item: SourceItem, start: float, fetched: float
    ) -> Staged | None:
        """Under ``lock``: ``item``, pulled from ``start`` to ``fetched``, staged as micro-batch
        ``index``; or released, and None, once stopped (the teardown may already have run)."""
        if self.stop:
            _release(plan_staging(item))
            return None
        return self._stage(index, item, fetched, fetch_s=fetched - start)

    def take(self, timeout_s: float) -> Staged | Failure | End:
        """Consumer side: the next record, in order; raises if the thread died without one, or
        ``TimeoutError`` after ``timeout_s`` (the source is slow or stuck)."""
        try:
            return self.ready.get_nowait()
        except queue.Empty:
            pass
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                return self.ready.get(timeout=max(0.0, min(_ANNOUNCED_WAIT_S, left)))
            except queue.Empty:
                if not self.alive() and self.ready.empty():
                    raise RuntimeError("the prefetch thread exited without a result") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"no micro-batch from the source within next_timeout_s={timeout_s} s; "
                        "raise MicroBatchIterator.Config.next_timeout_s for a slower source"
                    ) from None

    def release_held(self) -> None:
        """Consumer side: the held micro-batch is done; recycle its staging slot, retire its
        lease (NOTE [ Zero-copy hand-off ])."""
        held, self.held = self.held, None
        if held is not None:
            if held.slot is not None:
                self.transport.release(held.slot)
            if held.release is not None:
                self.retired.put(held)
                if self.in_source:  # the thread may wait for exactly this slot
                    self.release_retired()

    def release_copied(self) -> None:
        """Hand back the source slots of in-place device copies, each once its copy finished
        (prefetch thread, or teardown; NOTE [ Registered source rings ])."""
        while self.copied:
            try:
                slot, release = self.copied.popleft()
            except IndexError:
                return
            self.transport.wait_copy(slot)
            with self.release_lock:
                release()

    def release_retired(self) -> None:
        """Hand every retired lease back to its producer (either thread)."""
        if self.retired.empty():  # the usual case on the staging path: no lock, no exception
            return
        with self.release_lock:  # the one drainer: what empty() denies, get_nowait() has
            while not self.retired.empty():
                record = self.retired.get_nowait()
                assert record.release is not None
                record.release()

    def interrupt_source(self) -> bool:
        """Call the source's ``interrupt()`` if it has one (a ``next()`` blocked in it ends at
        once); False if it has none."""
        interrupt = getattr(self.source, "interrupt", None)
        if not callable(interrupt):
            return False
        interrupt()
        return True

    def shutdown(self) -> None:
        """Stop the thread and free the ring; idempotent. See NOTE [ Prefetch thread shutdown ]."""
        if self._closed:
            return
        self._closed = True
        if threading.current_thread() is self.thread and not self.done.is_set():
            # GC ran the finalizer inside the thread, which may hold ``lock``: let it tear down.
            self._teardown_in_worker = True
            self.request_stop()
            return
        self.request_stop()
        self.interrupt_source()
        if self.thread.ident is not None:  # started
            self.done.wait(self.join_timeout_s)
        self._teardown()
        if self.thread.ident is not None and not self.done.is_set():
            warnings.warn(
                f"{self.thread.name} is still inside next(source) {self.join_timeout_s}s after "
                "close(); it is a daemon thread and exits with the process; make the source's "
                "next() return (or time out), or give the source an interrupt(), to stop it sooner",
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
            self._private_views.clear()
            self._slots.clear()
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
    """A tensor over ``view``'s bytes, no copy, as the SOURCE of an in-place device copy only
    (never handed to the training loop). torch has no read-only tensors and warns on a read-only
    array, so a published slot's read-only view is exposed as is."""
    if view.flags.writeable:
        return torch.from_numpy(view)
    return torch.from_numpy(np.asarray(_Exposed(view)))


def _release(plan: StagingPlan) -> None:
    if plan.release is not None:
        plan.release()


# NOTE [ One prefetch thread per rank ]
# Lifecycle table: docs/lifecycle.md.
# A rank of a job runs one iterator per pass (three per
# GRPO step), and each started, then ended, its own thread. A start costs more than the clone:
# ``benchmarks/grpo_step.py --quick`` (4 ranks, 2 micro-batches per pass, load ~10, RANK2's
# scratch per-thread CPU at 98e1fff) measured 2.4 ms of prefetch-thread CPU per pass, of which
# only 1.9 ms ran inside the prefetch itself (fetch 0.6, staging 0.3, conversion 0.9): ~0.5 ms per
# thread went to its start and end (bootstrap, a fresh stack and malloc arena faulted in), and the
# iterator's constructor took 0.26 ms of the loop's thread to start it. ``PrefetchThreads`` keeps
# the threads: an iterator built with one runs its prefetch on an idle thread of the set, or on a
# new one that joins it, and the thread waits for the next iterator when the prefetch ends. Each
# prefetch behaves as on its own thread: it ends (``Prefetcher.done``) on close, end of data or
# error, exactly as the thread did, and close() joins that end, not the thread. A thread whose
# prefetch is still inside an uninterruptible source after close() is not idle, so it is never
# handed a second prefetch: the next iterator gets another thread. The set's ``close()`` ends its
# idle threads at once and the busy ones when their prefetch ends (a ``RankHandle`` closes its set
# when it closes); interpreter exit closes every set. An iterator built without one (the default)
# starts and ends its own thread, as before. Measured (``grpo_step.py --quick``, 5 back-to-back
# pairs against 98e1fff, load 10-13): 36 thread starts in 3 steps -> 8 (two per rank, the pass
# ahead overlapping the current one; none once warm), the prefetch threads' CPU (every rank,
# ``threads.exited`` + ``threads.knitkit-microbatch-prefetch``) 22.3 -> 18.6 ms per step (median
# per-pair cut 4.1); the constructor's share of the loop's thread 0.26 -> 0.22 ms per pass. What
# is left, ~2 ms per pass, is the prefetch itself: per micro-batch the conversion ~0.45 ms, the
# hand-out ~0.35 ms, staging ~0.14 ms.
# A reused thread starts each prefetch with torch's grad mode on, as a new thread does, so a
# ``convert`` that turned it off without a context manager does not change the next pass's
# conversion. Other thread-local state a ``convert`` leaves behind (a ``threading.local``, an
# autocast or inference mode entered and never exited) carries over: enter it per call, in a
# ``with``.


def _thread_name() -> str:
    return f"knitkit-microbatch-prefetch-{next(_THREAD_IDS)}"


_THREAD_IDS = itertools.count()


class PrefetchThreads:
    """Prefetch threads reused by the iterators built with it, one iterator per thread at a time
    (NOTE [ One prefetch thread per rank ]); ``close()`` ends them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_ReusedThread] = []
        self._closed = False
        self.started = 0
        """Threads this set started (for tests and figures)."""
        _POOLS.add(self)

    def run(self, prefetcher: Prefetcher) -> bool:
        """Run ``prefetcher`` on an idle thread, or a new one; False once closed."""
        with self._lock:
            if self._closed:
                return False
            if self._idle:
                reused = self._idle.pop()
            else:
                reused = _ReusedThread(self)
                self.started += 1
                reused.thread.start()
        prefetcher.thread = reused.thread
        reused.jobs.put(prefetcher)
        return True

    def idle(self, reused: _ReusedThread) -> bool:
        """``reused`` waits for the next prefetch; False (it ends) once closed."""
        with self._lock:
            if self._closed:
                return False
            self._idle.append(reused)
            return True

    def close(self) -> None:
        """End the idle threads now and the busy ones when their prefetch ends; idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for reused in idle:
            reused.jobs.put(None)


class _ReusedThread:
    """One thread of a ``PrefetchThreads``: runs the prefetches it is handed, one at a time."""

    __slots__ = ("jobs", "owner", "thread")

    def __init__(self, owner: PrefetchThreads) -> None:
        self.owner = owner
        self.jobs: queue.SimpleQueue[Prefetcher | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=_thread_name(), daemon=True)

    def _loop(self) -> None:
        while True:
            try:  # announced (run() or close() puts one); the slice bounds a missed one
                job = self.jobs.get(timeout=_ANNOUNCED_WAIT_S)
            except queue.Empty:
                if self.owner._closed:
                    return
                continue
            if job is None:
                return
            # Grad mode on, as on a new thread (NOTE [ One prefetch thread per rank ]).
            torch.set_grad_enabled(True)
            try:
                job._prefetch()
            finally:  # idle before the prefetch's end is seen: the next iterator finds it
                idle = self.owner.idle(self)
                job.done.set()
            del job  # no reference to a finished iterator's state while idle
            if not idle:
                return


_POOLS: weakref.WeakSet[PrefetchThreads] = weakref.WeakSet()
_LIVE: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


@atexit.register
def _stop_live_threads() -> None:
    """Stop every prefetch thread before interpreter finalization (see NOTE [ Prefetch thread
    shutdown ])."""
    for threads in list(_POOLS):
        threads.close()  # idle threads end; busy ones once their prefetch below has stopped
    everyone = list(_LIVE)
    for prefetcher in everyone:  # a loop's thread inside an inline hand-out (daemon or not)
        if prefetcher.in_source and not prefetcher.alive():
            prefetcher.request_stop()
            prefetcher.interrupt_source()
    live = [prefetcher for prefetcher in everyone if prefetcher.alive()]
    for prefetcher in live:
        prefetcher.request_stop()
        if not prefetcher.interrupt_source() and prefetcher.in_source:
            abandon(prefetcher.thread)
    for prefetcher in live:
        prefetcher.done.wait(prefetcher.join_timeout_s)
    if any(p.alive() and p.exit_on_stuck_source for p in live):
        exit_now()
