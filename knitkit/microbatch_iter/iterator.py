"""The micro-batch iterator: delivers staged micro-batches in order while later ones are prepared."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar, overload

import torch

from knitkit.microbatch_iter.batch import (
    IterStats,
    MicroBatch,
    build_micro_batch,
)
from knitkit.microbatch_iter.exit_guard import note_exit
from knitkit.microbatch_iter.pool import StagingRing
from knitkit.microbatch_iter.source import SourceItem, inline_leases, source_items
from knitkit.microbatch_iter.transport import make_transport
from knitkit.microbatch_iter.worker import Failure, Prefetcher, PrefetchThreads, Staged

B = TypeVar("B")
"""What the iterator yields: ``MicroBatch``, or what its ``convert`` makes of one."""

# NOTE [ Conversion on the prefetch thread ]: a training loop rarely trains on a ``MicroBatch``
# itself; it turns each into the dict its forward step takes (``megatron_batch``: labels rolled,
# positions, the block-causal mask, ``PackedSeqParams``; GRPO's per-token weights on top). Run
# on the training thread after ``next()``, that is data-path time the loop waits for in full:
# ~0.3 ms of Python and small torch ops per micro-batch (``benchmarks/grpo_step.py --quick``,
# profiled at 30f28cf: 3.9 ms of a rank's "waiting for micro-batches" per GRPO step of 6
# micro-batches). ``convert`` runs it on the prefetch thread instead, right after the
# micro-batch is staged and under the same lock (teardown never frees a slot a conversion
# reads), so ``next()`` hands over the converted object. What stays true: the object may view
# the staged micro-batch, so it is valid until the next ``next()`` (clone what must live
# longer), as a ``MicroBatch`` is; the ``MicroBatch`` it is given carries ``stats`` without the
# loop's wait (``wait_s`` 0: not known yet; ``iterator.stats`` has it); a conversion that raises
# ends the thread, its micro-batch's lease goes back at once, and the loop's ``next()`` raises
# the error, as a source error does (NOTE [ Prefetch thread shutdown ] in worker.py). The
# conversion must be a function of the micro-batch alone (it runs up to ``depth`` micro-batches
# ahead, on another thread). On CUDA the staged bytes land by an asynchronous copy on the
# iterator's side stream, and kernels the conversion enqueues from the prefetch thread would
# need ordering after that copy (``h2d_done``) AND allocator lifetimes tied to the compute
# stream that later reads them (NOTE [ Stream/event hand-off ] in transport.py: a block freed
# by the loop could be handed to the next side-stream conversion while compute still reads it).
# So with a device copy the conversion runs at hand-over, on the training thread, after
# ``next()`` made the compute stream wait for the copy's event: ordered after the copy by
# construction, with the loop's own stream and allocator; the prefetch thread converts only
# where no device copy is involved (CPU), which is where it contends with the loop for cores.


# NOTE [ Refills in batches ]: with a prefetch thread, each ``next()`` returned one credit, and
# the thread, staged ahead and asleep, woke for it: one wake per micro-batch, paid by the loop's
# thread right after a step's compute. That wake is most of a hand-over: ``benchmarks/
# prefetch.py --quick`` (2-core dev box, load 0.6-1.0, issue 31) measured 60 us of the loop's
# CPU per hand-over, 44 us of it one bare ``SimpleQueue.put`` waking a blocked thread after the
# same compute (a futex wake and a cross-CPU wake of an idle virtual CPU, on caches the compute
# flushed: 16 us after a compute that read 4 KB, 34 us after 2.4 MB, 42 us after 8 MB). So
# credits go back ``refill`` at a time (one token worth ``refill``): the loop wakes the thread
# once per ``refill`` micro-batches and the thread stages that many then. It starts with
# ``depth + refill - 1`` credits, so the look-ahead at a hand-over never falls below
# ``depth - 1``, as with a credit per micro-batch, and is restored to ``depth + refill - 1`` at
# each refill; the price is ``refill - 1`` more slots (on CPU host memory for one micro-batch, or
# one more lease of the source's ring). Not chosen: waking at a lower mark inside ``depth + 1``
# slots (the look-ahead falls to ``depth - refill`` before each wake); the thread polling a
# counter on a timer (no wake to pay, but staging starts up to a period late and the thread
# wakes while idle); spinning (a core of two). The default is 2 on CPU and 1 with a device copy:
# there the loop's thread only enqueues kernels, and a slot more is device memory
# (``refill=2`` is allowed). ``stage_after_launch`` returns the credits of ``launched()`` the same
# way; ``refill=1`` gives the paper's one staging per launch. Measured (prefetch.py --quick, back
# to back, load 0.6-1.5): hand-over 63.7 -> 43.2 us (the loop's CPU 60.0 -> 39.7; the figure is
# now the median over pairs of hand-overs of their mean, benchmarks/README.md), X6/Y4 steady
# wait in ``next()`` 60.8 -> 41.3 us, ``cpu.exposed_ratio`` 0.054 -> 0.039.


class MicroBatchIterator(Iterator[B], Generic[B]):
    """Wraps a source of packed micro-batches and yields them staged on the device, in order.

    A background thread, started here, pulls from the source and stages ``depth`` micro-batches
    ahead (up to ``depth + refill - 1``: NOTE [ Refills in batches ]) into a ring of
    ``depth + refill`` reusable slots (pinned host + device
    buffers on CUDA, plain host buffers on CPU; a published shared-memory slot is read in
    place instead: NOTE [ Zero-copy hand-off ], NOTE [ Registered source rings ]); see NOTE
    [ Stream/event hand-off ] and NOTE [ Prefetch thread shutdown ]. Create it before the work
    that precedes the first micro-batch, so that one is staged meanwhile (warm start). Use it
    as a context manager, or call ``close()``. With ``convert`` it yields ``convert(micro_batch)``,
    run ahead on the prefetch thread (NOTE [ Conversion on the prefetch thread ]).
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Prefetch settings; the source and the device are runtime arguments of ``build``."""

        depth: int = 2
        """Micro-batches staged ahead of the one the training loop holds, restored at every
        refill (up to ``depth + refill - 1`` are); memory held is ``depth + refill`` slots."""
        refill: int | None = None
        """The prefetch thread is woken once per ``refill`` micro-batches the loop moves
        past, and then stages that many (NOTE [ Refills in batches ]); None: 2 on CPU, 1 with
        a device copy (CUDA), where an extra slot is device memory."""
        slot_nbytes: int = 0
        """Bytes each slot gets at start-up (size it to the token budget, so pinning happens
        once); slots grow to the next power of two when a larger micro-batch arrives."""
        stage_after_launch: bool = False
        """If True, staging the micro-batch ``depth`` ahead waits for ``launched()`` (paper
        section 6: after the current micro-batch's first kernel is launched); otherwise it
        starts as soon as ``next()`` hands the current one over."""
        join_timeout_s: float = 5.0
        """How long ``close()`` waits for the thread; a source blocked longer is abandoned."""
        next_timeout_s: float = 600.0
        """How long ``next()`` waits for the source's next micro-batch before ``TimeoutError``
        (no wait is unbounded by default; ``math.inf`` waits as long as the source takes)."""
        time_h2d: bool = False
        """CUDA: time every host-to-device copy with events (``stats.h2d_s``, after close)."""
        register_host: bool = True
        """CUDA: copy host-to-device straight from a source's published shared-memory slot,
        page-locking its ring in place once (cudaHostRegister; NOTE [ Registered source rings ]);
        False, or a ring that cannot be registered, copies each micro-batch into a pinned
        staging slot first."""
        hand_out_inline: bool = True
        """CPU: a source that hands out zero-copy leases inline (``MicroBatchConsumer`` and its
        ``take()``) is pulled on the training loop's thread inside ``next()``, with no prefetch
        thread: its producer's ring holds the look-ahead (NOTE [ Inline hand-out ] in
        worker.py). False runs the prefetch thread for it as for every other source."""
        exit_on_stuck_source: bool = False
        """At interpreter exit, if the prefetch thread is still inside ONE call of the source
        longer than ``join_timeout_s``: False finalizes normally (every atexit handler runs),
        True ends the process at once with the loop's exit status, skipping atexit handlers
        registered before knitkit (NOTE [ Exit with a thread inside the source ])."""

        @overload
        def build(
            self,
            source: Iterable[SourceItem],
            *,
            device: torch.device | str | None = None,
            convert: None = None,
            threads: PrefetchThreads | None = None,
        ) -> MicroBatchIterator[MicroBatch]: ...
        @overload
        def build(
            self,
            source: Iterable[SourceItem],
            *,
            device: torch.device | str | None = None,
            convert: Callable[[MicroBatch], B],
            threads: PrefetchThreads | None = None,
        ) -> MicroBatchIterator[B]: ...
        def build(
            self,
            source: Iterable[SourceItem],
            *,
            device: torch.device | str | None = None,
            convert: Callable[[MicroBatch], Any] | None = None,
            threads: PrefetchThreads | None = None,
        ) -> MicroBatchIterator[Any]:
            return MicroBatchIterator(source, self, device=device, convert=convert, threads=threads)

    @overload
    def __init__(
        self: MicroBatchIterator[MicroBatch],
        source: Iterable[SourceItem],
        config: Config | None = None,
        *,
        device: torch.device | str | None = None,
        convert: None = None,
        threads: PrefetchThreads | None = None,
    ) -> None: ...
    @overload
    def __init__(
        self: MicroBatchIterator[B],
        source: Iterable[SourceItem],
        config: Config | None = None,
        *,
        device: torch.device | str | None = None,
        convert: Callable[[MicroBatch], B],
        threads: PrefetchThreads | None = None,
    ) -> None: ...
    def __init__(
        self,
        source: Iterable[SourceItem],
        config: Config | None = None,
        *,
        device: torch.device | str | None = None,
        convert: Callable[[MicroBatch], B] | None = None,
        threads: PrefetchThreads | None = None,
    ) -> None:
        """``convert`` turns each micro-batch into what ``next()`` returns (NOTE [ Conversion
        on the prefetch thread ]); with ``threads`` the prefetch runs on a thread of that set
        instead of a thread of its own (NOTE [ One prefetch thread per rank ] in worker.py)."""
        self.config = config = config or MicroBatchIterator.Config()
        if config.depth < 1:
            raise ValueError(f"depth={config.depth}; prefetch needs depth >= 1")
        if config.refill is not None and config.refill < 1:
            raise ValueError(f"refill={config.refill}; the prefetch needs refill >= 1")
        self.device = _resolve(device)
        refill = config.refill or (1 if self.device.type == "cuda" else 2)
        slots = config.depth + refill
        transport = make_transport(
            self.device, slots, time_h2d=config.time_h2d, register_host=config.register_host
        )
        ring = StagingRing(slots, transport, config.slot_nbytes)
        items = source_items(source)
        inline = convert is None and not transport.copies_to_device and config.hand_out_inline
        self._inline = inline_leases(items) if inline else None
        """The source, pulled inside ``next()`` (NOTE [ Inline hand-out ] in worker.py)."""
        ahead = convert is not None and not transport.copies_to_device
        self._convert_here = None if ahead else convert
        """A conversion run at hand-over (CUDA: NOTE [ Conversion on the prefetch thread ])."""
        self._converted = convert is not None
        self._prefetcher = Prefetcher(
            items,
            ring,
            transport,
            depth=config.depth,
            refill=refill,
            join_timeout_s=config.join_timeout_s,
            exit_on_stuck_source=config.exit_on_stuck_source,
            convert=_converting(convert) if ahead and convert is not None else None,
            threads=threads,
        )
        self._stats = IterStats()
        self._events = transport.copies_to_device
        """Whether hand-over and release order device work (CUDA), else both are no-ops."""
        self._launch_pending = False
        self._finished = False
        self._consumer: threading.Thread | None = None
        self._consumer_ident: int | None = None
        """``_consumer``'s ident: ``next()`` compares it with ``threading.get_ident()``."""
        self._claim = threading.Lock()
        self._finalizer = weakref.finalize(self, self._prefetcher.shutdown)
        self._finalizer.atexit = False
        if self._inline is None:
            self._prefetcher.start()

    def __next__(self) -> B:
        start = time.perf_counter()
        if self._consumer_ident != threading.get_ident():
            self._check_consumer()
        if self._finished:
            raise StopIteration
        if self._inline is not None:
            return self._next_inline(start)
        prefetcher = self._prefetcher
        held = prefetcher.held
        if held is not None:
            if self._events or held.release is not None:
                prefetcher.release_held()  # see NOTE [ Zero-copy hand-off ] in worker.py
            else:  # a CPU staging slot: nothing to record or release
                prefetcher.held = None
        if self._launch_pending:  # stage_after_launch and the loop did not say launched()
            self.launched()
        try:
            record = prefetcher.ready.get_nowait()
        except queue.Empty:
            record = prefetcher.take(self.config.next_timeout_s)
        if type(record) is not Staged:
            self.close()
            if isinstance(record, Failure):
                raise record.error
            raise StopIteration
        if self._events and record.slot is not None:
            prefetcher.transport.hand_over(record.slot)
        prefetcher.held = record
        if self.config.stage_after_launch:
            self._launch_pending = True
        else:  # launched(): Prefetcher.return_credit inline (a frame per hand-over fewer)
            owed = prefetcher.owed + 1
            if owed == prefetcher.refill:  # NOTE [ Refills in batches ]
                prefetcher.credits.put(owed)
                owed = 0
            prefetcher.owed = owed
        batch = record.batch  # built ahead (NOTE [ Micro-batches built ahead ] in worker.py)
        assert batch is not None
        if self._converted and self._convert_here is None:
            self._stats.record(record, time.perf_counter() - start)  # the converted one's: wait 0
            return record.converted  # type: ignore[return-value]
        self._stats.handed(batch.stats, time.perf_counter() - start)
        if self._convert_here is not None:
            return self._convert_here(batch)
        return batch  # type: ignore[return-value]

    def _next_inline(self, start: float) -> B:
        """``next()`` taking the source's next lease on this thread (NOTE [ Inline hand-out ] in
        worker.py): its errors are raised as the thread's would be; a timeout leaves the
        iterator open, as ``Prefetcher.take``'s does."""
        assert self._inline is not None
        timeout_s = self.config.next_timeout_s
        try:
            record = self._prefetcher.hand_out(self._stats.count, self._inline, timeout_s)
        except TimeoutError as error:
            raise TimeoutError(
                f"{error} (next_timeout_s={timeout_s} s); raise "
                "MicroBatchIterator.Config.next_timeout_s for a slower source"
            ) from error
        except BaseException:
            self.close()
            raise
        if record is None:
            self.close()
            raise StopIteration
        wait_s = time.perf_counter() - start
        batch = build_micro_batch(record, wait_s)
        self._stats.handed(batch.stats, wait_s)
        return batch  # type: ignore[return-value]

    def _check_consumer(self) -> None:
        """One consumer thread per iterator: the first to call ``next()`` owns it until a
        ``claim()`` hands it over."""
        me = threading.current_thread()
        if self._consumer is not me:
            with self._claim:
                if self._consumer is None:
                    self._consumer, self._consumer_ident = me, me.ident
            if self._consumer is not me:
                raise RuntimeError(
                    f"MicroBatchIterator is consumed by thread {self._consumer.name!r}; next() "
                    f"from thread {me.name!r} would tear or drop micro-batches. Use one consumer "
                    "thread at a time: to move the loop to this thread, call iterator.claim() "
                    "here once the other thread stopped calling next()"
                )

    def claim(self) -> None:
        """Make the calling thread the one that calls ``next()`` from now on (a hand-over: the
        previous thread must have stopped calling it; on CUDA its current stream becomes the
        compute stream the micro-batches are ordered before)."""
        with self._claim:
            self._consumer = threading.current_thread()
            self._consumer_ident = self._consumer.ident

    def launched(self) -> None:
        """Tell the iterator the held micro-batch's first kernel is launched; staging may go on.

        Only needed with ``stage_after_launch=True``; ``next()`` implies it otherwise.
        """
        if self._launch_pending:
            self._launch_pending = False
            self._prefetcher.return_credit()

    @property
    def pool(self) -> StagingRing:
        """The staging ring, for inspection (``allocations``, ``held_bytes``)."""
        return self._prefetcher.ring

    @property
    def stats(self) -> IterStats:
        """Totals so far (``h2d_s`` is filled in by ``close()``)."""
        self._stats.h2d_s = self._prefetcher.transport.h2d_seconds
        return self._stats

    def metrics(self) -> dict[str, float]:
        """This iterator's figures, cumulative since it was created:

        - ``knitkit/delivery/exposed_wait_s``: seconds the training loop spent inside ``next()``
          after the first micro-batch (the wait prefetch is meant to hide);
        - ``knitkit/delivery/first_wait_s``: the wait for the first micro-batch (nothing to
          overlap it with);
        - ``knitkit/delivery/fetch_s``: seconds the prefetch thread spent in ``next(source)``
          (for a ``MicroBatchConsumer``: waiting for publication, decoding, mapping);
        - ``knitkit/delivery/stage_s``: seconds it spent staging (copy, device copy issue);
        - ``knitkit/delivery/micro_batches`` and ``knitkit/delivery/bytes``: what it delivered;
        - ``knitkit/delivery/h2d_s``: device time of the host-to-device copies (CUDA with
          ``time_h2d=True``, collected as copies are reused and at close).
        """
        stats = self.stats
        return {
            "knitkit/delivery/exposed_wait_s": stats.steady_wait_s,
            "knitkit/delivery/first_wait_s": stats.first_wait_s,
            "knitkit/delivery/fetch_s": stats.fetch_s,
            "knitkit/delivery/stage_s": stats.stage_s,
            "knitkit/delivery/micro_batches": float(stats.count),
            "knitkit/delivery/bytes": float(stats.nbytes),
            "knitkit/delivery/h2d_s": stats.h2d_s,
        }

    def close(self) -> None:
        """Stop the prefetch thread, free the staging ring and close the source; idempotent."""
        self._finished = True
        self._finalizer()

    def __enter__(self) -> MicroBatchIterator[B]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        note_exit(exc)
        self.close()


def _converting(convert: Callable[[MicroBatch], object]) -> Callable[[Staged], Staged]:
    """``convert`` as the prefetch thread applies it to a staged record (NOTE [ Conversion on
    the prefetch thread ]): a record whose conversion raised gives its lease back at once."""

    def run(record: Staged) -> Staged:
        assert record.batch is not None  # its stats' wait_s stays 0: not known yet
        try:
            return dataclasses.replace(record, converted=convert(record.batch))
        except BaseException:
            if record.release is not None:  # the record never reaches the loop
                record.release()
            raise

    return run


def _resolve(device: torch.device | str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
