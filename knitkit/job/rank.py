"""The per-rank handle: the schedule, this rank's data and encoder rings, and its write-back ring."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from knitkit.encoder_dedup import RankRoute
from knitkit.job.completion import PassEnds
from knitkit.job.errors import (
    PRODUCER_CAUSE,
    DriverDiedError,
    DriverNotFoundError,
    producer_failed,
)
from knitkit.job.passes import Pass, read_next
from knitkit.job.pool import pass_id
from knitkit.job.records import Record, RecordReader, RecordWriter
from knitkit.job.recovery import FollowingConsumer, restarts_of
from knitkit.job.spec import PREFETCH_DEPTH, RankCoords, RankSpec, encoder_rank_name, group_name
from knitkit.job.watch import DRIVER, DriverWatch, Gate, PassTake, driver_error
from knitkit.job.work import PassWork, Route
from knitkit.metrics import merge, sum_over
from knitkit.microbatch_iter import MicroBatch, MicroBatchIterator, PrefetchThreads
from knitkit.storage import (
    MiniBatchPlan,
    ReorganizerDiedError,
    ReorganizerError,
)
from knitkit.storage.delivery import RingNotReadyError
from knitkit.types import UnitKey

_LEAVE_S = 5.0
"""How long a rank leaving through an error lets its pass-end thread publish what it holds (its
error record among them) before its write-back ring fails."""

_H2D = "knitkit/delivery/h2d_s"
_ITERATOR_FIGURES = (
    "knitkit/delivery/exposed_wait_s",
    "knitkit/delivery/first_wait_s",
    "knitkit/delivery/fetch_s",
    "knitkit/delivery/stage_s",
    "knitkit/delivery/micro_batches",
    "knitkit/delivery/bytes",
    _H2D,
)


Convert = Callable[[PassWork, MicroBatch], object]
"""Turns one micro-batch of a pass into what the pass's iterator yields (``RankHandle(convert=)``)."""


class Taken(Protocol):
    """A bounded take from a ring consumer (``MicroBatchConsumer.take``): how many it handed out."""

    taken: int


class RankHandle:
    """One training rank's handle on the job: ``for work in rank.passes():`` yields a
    ``PassWork`` per (mini-batch, pass) in the driver's serving order, the same on every rank.

    It attaches once: to the schedule (every rank), its (DP, CP) group's data ring of its
    pipeline stage (as consumer ``tp``), its encoder rank's ring (if it encodes) and, on the group's writer
    rank (TP 0, last stage), creates the write-back ring to the driver. Nothing else is needed
    than the driver's ``RankSpec`` and where the rank sits (``RankCoords``).

    A rank that leaves through an exception out of ``with`` or in the middle of a pass (or whose
    process exits through Python without closing it) leaves its rings failed, not waiting: its
    write-back ring (writer ranks) fails with the reason, so the driver fails naming the group,
    and its reorganizers fail their rings naming it once they wait for it, so its TP peers raise
    at once (NOTE [ Micro-batch publication protocol ], "Dead consumers"). Closing between passes
    is a clean end: the driver may still drain what the rank finished.

    A pass's end (its iterator closed, its write-back and ``done`` records published) runs on
    the rank's pass-end thread: ``done`` and ``write_back`` return once the job is queued (NOTE
    [ Asynchronous pass ends ] in completion.py).
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Prefetch settings of every pass's iterator; the device is a runtime argument."""

        depth: int = PREFETCH_DEPTH
        """Micro-batches staged ahead of the one the training loop holds (a deeper prefetch
        wants ``Driver.Config.num_slots`` of at least ``depth + 2``: NOTE [ Data ring slots ]
        in driver.py); a pass handed out inline reads ahead only as far as its ring (NOTE
        [ Passes inline ])."""
        slot_nbytes: int = 0
        """Bytes each staging slot gets at start-up (size it to the token budget)."""
        next_timeout_s: float = 600.0
        """Bound of one micro-batch's wait (a later pass's first one waits for the group's
        inputs to be written back: NOTE [ Next pass per group ] in serving.py)."""
        sends_ahead: int = 16
        """Pass-end jobs (a write-back or ``done`` record, an iterator to close) the rank queues
        ahead of its pass-end thread; a full queue blocks the rank, at most the spec's
        ``wait_timeout_s`` (NOTE [ Asynchronous pass ends ] in completion.py)."""

    def __init__(
        self,
        spec: RankSpec,
        coords: RankCoords,
        config: Config | None = None,
        *,
        device: torch.device | str | None = None,
        route: Route | None = None,
        convert: Convert | None = None,
    ) -> None:
        """``route(plan)`` gives this rank's dedup route for passes that encode
        (``MegatronLayout.route``, or ``route_minibatch(...).for_rank(rank)``): a pure
        function, called once per mini-batch, on the rank's pass-end thread (NOTE [ One pass
        ahead ]). ``convert(work, micro_batch)`` turns each micro-batch of a pass into what
        its iterator yields (e.g. the dict a forward step takes), on the pass's prefetch thread
        ahead of the loop (NOTE [ Conversion on the prefetch thread ] in
        knitkit/microbatch_iter/iterator.py)."""
        coords.check(spec)
        self.spec, self.coords = spec, coords
        self.config = config or RankHandle.Config()
        self.device = device
        self._route = route
        self._convert = convert
        self._threads = PrefetchThreads()
        """Every pass's prefetch thread (NOTE [ One prefetch thread per rank ] in
        knitkit/microbatch_iter/worker.py), where a pass's iterator has one."""
        self._inline = convert is None and _cuda_device(device) is None
        """Whether each pass's iterator hands out on the loop's thread, with no prefetch thread
        (CPU, no ``convert``: NOTE [ Inline hand-out ] in knitkit/microbatch_iter/worker.py):
        closing it then only releases the lease the loop holds (NOTE [ Passes inline ])."""
        self.writer = coords.is_writer(spec)
        self._plans: dict[str, MiniBatchPlan] = {}
        self._pass_plans: dict[str, MiniBatchPlan] = {}
        """The next mini-batch's later passes' plans, restricted to their fields by the
        look-ahead (NOTE [ One mini-batch ahead ]), by pass name."""
        self._current: PassWork | None = None
        self._last: tuple[str, int] | None = None
        """(mini-batch, pass index) of the last pass handed out."""
        self._totals: dict[str, float] = dict.fromkeys(_ITERATOR_FIGURES, 0.0)
        self._kept: tuple[str, dict[UnitKey, torch.Tensor]] | None = None
        """The current mini-batch's encoder inputs, read by its first encoding pass (see
        NOTE [ Encoder inputs once per mini-batch ])."""
        self._units_taken: tuple[str, str] | None = None
        """The (mini-batch, pass) whose units were last taken from the encoder ring."""
        self._routes: dict[str, RankRoute] = {}
        """The dedup routes of the current mini-batch, shared by its passes (NOTE [ One pass
        ahead ]), and of the next one (NOTE [ One mini-batch ahead ])."""
        self._routing = threading.Lock()
        self._encoder = threading.RLock()
        """Guards the encoder ring's takes and the kept inputs: the loop's thread and the
        pass-end thread (its copy of a mini-batch's inputs) both take (NOTE [ One pass ahead ])."""
        self._copied: tuple[str, dict[UnitKey, torch.Tensor]] | None = None
        """A mini-batch's encoder inputs copied to host memory ahead, not yet on ``device``."""
        self._ahead: PassWork | None = None
        """The mini-batch's next pass, its prefetch started (NOTE [ One pass ahead ])."""
        self._peek: int | None = None
        """The pass-end job that waits for the next mini-batch's schedule record (NOTE [ One
        mini-batch ahead ])."""
        self._peek_cancel = threading.Event()
        self._peeked: _Peeked | None = None
        """What that job read: the record, and its opened plan and first pass if it got that far."""
        self.first_encoding = next((p.name for p in spec.passes if p.encodes), None)
        """The pass the driver serves a mini-batch's encoder units with (NOTE [ Encoder inputs
        once per mini-batch ])."""
        self._last_encoding = next((p.name for p in reversed(spec.passes) if p.encodes), None)
        self.read_next = read_next(spec.passes)
        """Passes whose outputs the next pass reads: the first ``values`` record of each goes
        at once (``PassWork.write_back``; NOTE [ Serving as write-backs arrive ] in
        serving.py)."""
        self._token_counts: tuple[str, list[int]] | None = None
        """The current mini-batch's packed tokens per micro-batch (``token_counts``)."""
        self._closed = False
        waits = {
            "liveness_timeout_s": spec.liveness_timeout_s,
            "wait_timeout_s": spec.wait_timeout_s,
        }
        group = group_name(coords.dp, coords.cp)
        with contextlib.ExitStack() as stack, _driver_rings(spec, coords.rank):
            schedule, index = spec.schedule_of(coords.rank)  # its node's ring, across nodes
            self._schedule = RecordReader(schedule, index, producer=DRIVER, **waits)
            stack.callback(self._schedule.close)
            # waits on data rings hear of the driver: NOTE [ Next pass per group ] in serving.py
            self._watch = DriverWatch(
                schedule, coords.rank, liveness_timeout_s=spec.liveness_timeout_s
            )
            stack.callback(self._watch.close)
            # follows its reorganizer across restarts: see NOTE [ Reorganizer restart ]
            restarts = restarts_of(spec.extra)
            self._data = FollowingConsumer(
                spec.rings[coords.data_ring(spec)],
                coords.consumer_index(spec),
                restarts=restarts,
                **waits,
            )
            stack.callback(self._data.close)
            self._units: FollowingConsumer | None = None
            if coords.encoder_rank is not None:
                name = encoder_rank_name(spec.encoders[0].name, coords.encoder_rank)
                self._units = FollowingConsumer(
                    spec.rings[name], coords.encoder_consumer, restarts=restarts, **waits
                )
                stack.callback(self._units.close)
            # the writer rank creates its write-back ring (see NOTE [ Records over slot rings ]
            # in records.py): the driver's collector attaches once it exists
            self._writeback = (
                RecordWriter(
                    spec.write_back[group],
                    owns_ring=True,
                    role=f"rank {coords.rank}",
                    liveness_timeout_s=spec.liveness_timeout_s,
                )
                if self.writer
                else None
            )
            if self._writeback is not None:
                stack.callback(self._writeback.close)
            self._ends = PassEnds(
                coords.rank,
                depth=self.config.sends_ahead,
                timeout_s=spec.wait_timeout_s,
                on_failure=self._pass_end_failed,
                on_start=functools.partial(_on_device, _cuda_device(device)),
            )
            stack.pop_all()

    @property
    def convert(self) -> Convert | None:
        """What each pass's iterator applies to its micro-batches (``None``: it yields them)."""
        return self._convert

    def passes(self) -> Iterator[PassWork]:
        """Every pass the driver serves, in order, until it finishes (see ``next_pass``)."""
        while (work := self.next_pass()) is not None:
            yield work

    def next_pass(self, timeout_s: float | None = None) -> PassWork | None:
        """The next (mini-batch, pass), or ``None`` once the driver finished; an unfinished
        previous one is finished first (``done``). A mini-batch's first pass waits for its
        schedule record at most ``timeout_s`` (default: the spec's ``wait_timeout_s``); its
        later passes follow at once, their data on this rank's rings (NOTE [ Next pass per
        group ] in serving.py). Raises ``DriverFailedError`` / ``DriverDiedError``."""
        if self._closed:
            raise RuntimeError("the rank handle is closed")
        if self._current is not None:
            self._current.done()
            self._current = None
        self._ends.raise_failure()
        passes = self.spec.passes
        if self._last is not None and self._last[1] + 1 < len(passes):
            self._watch.raise_failure()
            minibatch_id, index = self._last[0], self._last[1] + 1
        else:
            peeked = self._end_peek()
            if peeked is not None and peeked.work is not None:
                self._ahead = peeked.work  # opened and started by the look-ahead
                if peeked.work.pass_.encodes:  # its units now: the last pass's were released
                    self._ends.post(
                        f"copying the encoder inputs of {peeked.work.minibatch_id!r}",
                        functools.partial(self._copy_ahead, peeked.work),
                    )
            if peeked is not None and peeked.opened is not None:
                minibatch_id, self._plans[minibatch_id] = peeked.opened
                self._pass_plans = peeked.pass_plans
            else:
                try:
                    record = peeked.record if peeked is not None else self._schedule.next(timeout_s)
                except (ReorganizerDiedError, ReorganizerError) as error:
                    raise driver_error(self.coords.rank, error) from None
                if record is None:
                    return None
                minibatch_id, self._plans[minibatch_id] = self._open(record)
                self._pass_plans = {}
            index = 0
        plan = self._plans[minibatch_id]
        if index + 1 == len(passes):
            del self._plans[minibatch_id]
        self._last = (minibatch_id, index)
        # a later pass was built, its prefetch started, with the previous one (NOTE [ One pass
        # ahead ]); a mini-batch's first pass starts here, or with the mini-batch before it
        # (NOTE [ One mini-batch ahead ])
        work = self._ahead or self._start_ahead(minibatch_id, passes[index], plan, after=None)
        self._current, self._ahead = work, None
        if index + 1 < len(passes):
            self._ahead = self._start_ahead(
                minibatch_id, passes[index + 1], plan, after=work.drained
            )
        else:
            self._start_peek(work)
        return work

    def _open(self, record: Record) -> tuple[str, MiniBatchPlan]:
        """A mini-batch's schedule record: its id and plan (checked to open the first pass)."""
        passes = self.spec.passes
        minibatch_id, name = str(record.header["mb"]), str(record.header["pass"])
        if name != passes[0].name or "plan" not in record.arrays:
            raise RuntimeError(
                f"rank {self.coords.rank}: the schedule opened {minibatch_id!r} with pass "
                f"{name!r}, not {passes[0].name!r} with its plan: the driver and this rank "
                "run different passes; restart the job with one spec"
            )
        return minibatch_id, MiniBatchPlan.from_json(record.arrays["plan"].tobytes().decode())

    # NOTE [ One mini-batch ahead ]: a mini-batch's first pass could not start ahead (NOTE [ One
    # pass ahead ]): its plan comes with its schedule record, which the loop read in
    # ``next_pass``, then decoded the plan and built the dedup route on the training thread
    # (``benchmarks/grpo_step.py --quick`` at 9a7d30c, load ~4: "waiting for the next pass" 0.7
    # ms and "reading encoder inputs" 1.7-3.2 ms per step on every rank, 1.2 ms of it the
    # route's CPU). The driver announces mini-batch k + 1 once every group got every pass of k
    # (NOTE [ Next pass per group ] in serving.py), long before the rank ends k's last pass
    # (train: its forward-backward). So when ``next_pass`` hands out a mini-batch's last pass,
    # it queues one more job on the pass-end thread, which then idles until that pass ends: wait
    # for the next schedule record; with it, decode the plan, restrict it to each pass's fields
    # (``with_fields``: ~0.1 ms of the loop's "waiting for the next pass" per later pass, under
    # cProfile in ``grpo_step.py``), build the next first pass's work
    # (its take gated on the last pass's ``drained``, as a later pass is), start its prefetch
    # and build its route (``_prepare``). The training thread takes the result in ``next_pass``.
    # - The wait never holds up the rank's own jobs: the loop's thread cancels it (an event the
    #   record wait checks: ``InterruptedError``, the reader stays as it was) before it queues
    #   anything (a record, a pass's end) and when it closes; a record that arrived first is
    #   kept either way, so none is lost and the reads stay in the ring's order. A cancelled
    #   look-ahead leaves ``next_pass`` to read the record itself, as before. No deadlock: the
    #   driver's announcement of k + 1 does not wait for anything this rank queues after k's
    #   last pass was handed out (its earlier write-backs were queued, so published, first).
    # - Failures stay the loop's: the look-ahead swallows every error (the record's read then
    #   happens again on the training thread and raises there, e.g. the driver's failure); one
    #   after the read keeps the record for ``next_pass``, which opens it and raises.
    # - The encoder units of k + 1 are copied by the look-ahead too, once the encoder ring's
    #   next units are k + 1's (k's were taken, or k's last pass was not the one they were
    #   served with: NOTE [ Encoder inputs once per mini-batch ]); the loop copied them itself
    #   at ``next_pass`` before: 2.5-7.5 ms of "reading encoder inputs" on a rank's worst steps
    #   at load ~12, ``benchmarks/grpo_step.py`` at 32dd9cf.
    def _start_peek(self, last: PassWork) -> None:
        """Queue the look-ahead for the mini-batch after ``last``'s (NOTE [ One mini-batch
        ahead ])."""
        self._peek_cancel.clear()
        self._peek = self._ends.post(
            f"waiting for the schedule after {last.minibatch_id!r}",
            functools.partial(self._peek_next, last),
        )

    def _peek_next(self, last: PassWork) -> None:
        """Pass-end thread: the next schedule record, opened, its first pass started and its
        encoder inputs copied."""
        try:
            record = self._schedule.next(cancel=self._peek_cancel)
        except Exception:  # cancelled, or the loop's own read raises it again
            return
        peeked = self._peeked = _Peeked(record)
        if record is None:
            return
        here = (last.minibatch_id, last.pass_.name)
        free = not last.encoder_micro_batches() or (
            self._units_taken == here
        )  # the encoder ring's next units are the new mini-batch's
        with contextlib.suppress(Exception):  # the loop's own call raises it
            minibatch_id, plan = self._open(record)
            first, *later = self.spec.passes
            peeked.pass_plans = {p.name: plan.with_fields(p.reads) for p in later}
            peeked.opened = minibatch_id, plan
            work = PassWork(
                self, minibatch_id, first, plan.with_fields(first.reads), after=last.drained
            )
            peeked.work = work
            self._prepare(work)
            if free:
                self.copy_encoder_inputs(work)

    def _copy_ahead(self, work: PassWork) -> None:
        """Pass-end thread: ``work``'s encoder inputs into host memory (a failure is left to
        the loop's own call, which copies them again and raises)."""
        with contextlib.suppress(Exception):
            self.copy_encoder_inputs(work)

    def _cancel_peek(self) -> None:
        """End the look-ahead's wait (the loop's thread is about to queue a job)."""
        if self._peek is not None:
            self._peek_cancel.set()

    def _end_peek(self) -> _Peeked | None:
        """The look-ahead's result, once its job ended (cancelled if it still waits)."""
        job, self._peek = self._peek, None
        if job is None:
            return None
        self._peek_cancel.set()
        self._ends.wait(job)
        peeked, self._peeked = self._peeked, None
        return peeked

    def _start_ahead(
        self, minibatch_id: str, pass_: Pass, plan: MiniBatchPlan, *, after: Gate | None
    ) -> PassWork:
        """``pass_``'s work, its prefetch started on the pass-end thread; with ``after``, its
        take waits for that gate (the previous pass's leases all taken: NOTE [ One pass
        ahead ])."""
        restricted = self._pass_plans.pop(pass_.name, None) or plan.with_fields(pass_.reads)
        work = PassWork(self, minibatch_id, pass_, restricted, after=after)
        self._ends.post(
            f"starting the prefetch of pass {pass_.name!r} of {minibatch_id!r}",
            functools.partial(self._prepare, work),
        )
        return work

    def _prepare(self, work: PassWork) -> None:
        """On the pass-end thread: start ``work``'s prefetch and, for a pass that encodes, build
        its mini-batch's route (NOTE [ One pass ahead ]). A failure is left to the loop's own
        call (``micro_batches()``, ``route``), which does it again and raises."""
        with contextlib.suppress(Exception):
            work.prefetch()
            if not work.pass_.encodes:
                return
            if self._route is not None:
                self.route_of(work)
            if work.after is None:  # not a pass started ahead: its units are served with it
                self.copy_encoder_inputs(work)

    def metrics(self) -> dict[str, float]:
        """This rank's delivery figures, cumulative since it attached: its ring consumers'
        (``knitkit/delivery/consumer_wait_s``, ``decode_s``, ``handed_out``, ...) and every
        pass's prefetch iterator's, added up (``exposed_wait_s``, ``micro_batches``, ...; a
        pass's ``h2d_s`` once its pass-end thread closed the iterator)."""
        consumers = [self._data.metrics()]
        if self._units is not None:
            consumers.append(self._units.metrics())
        return merge(sum_over(consumers), self._totals)

    def close(self, reason: str = "") -> None:
        """Finish nothing more: detach from every ring. The writer ends its write-back ring: the
        driver's collector stops after its last record, or fails the job naming this rank and
        ``reason`` (an exception out of ``with``) or the pass it left unfinished. A clean close
        first lets the pass-end thread publish what it holds (bounded by the spec's
        ``wait_timeout_s``) and raises its failure; with ``reason`` it gets at most 5 s
        (NOTE [ Asynchronous pass ends ] in completion.py). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._current is not None and not self._current.finished:
            where = f"pass {self._current.pass_.name!r} of {self._current.minibatch_id!r}"
            reason = f"{reason}; in {where}" if reason else f"closed in {where}"
            self._current.stop_prefetch()
        if self._ahead is not None:
            self._ahead.stop_prefetch()
        self._cancel_peek()
        failure: BaseException | None = None
        if not reason:
            try:
                self._ends.wait()
            except BaseException as error:  # raised below, once every ring is detached
                failure = error
                reason = f"{type(error).__name__}: {error}"
        self._ends.stop(0.0 if failure is not None else _LEAVE_S)
        if self._writeback is not None and self._ends.busy:
            self._writeback.stop()  # a publication blocked on a full ring gives up
        self._ends.join()
        if self._peeked is not None and self._peeked.work is not None:
            self._peeked.work.stop_prefetch()  # a first pass the look-ahead started
        if self._writeback is not None:
            if reason:
                self._writeback.fail(f"rank {self.coords.rank} left: {reason}")
            else:
                self._writeback.finish()
            self._writeback.close()
        for consumer in (self._data, self._units):
            if consumer is not None:
                consumer.close()
        self._watch.close()
        self._schedule.close()
        self._threads.close()
        if failure is not None:
            raise failure

    def __enter__(self) -> RankHandle:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: object, tb: object) -> None:
        self.close(f"{kind.__name__}: {error}" if kind is not None else "")

    # ----- for PassWork --------------------------------------------------------------------------
    def route_of(self, work: PassWork) -> RankRoute:
        """``work``'s mini-batch's dedup route, built by its first pass that asks (NOTE [ One
        pass ahead ])."""
        if self._route is None:
            raise RuntimeError(
                "this RankHandle has no route function; build it with route=... (e.g. "
                "MegatronLayout.route) to run the encoder with dedup"
            )
        with self._routing:  # one build, on the pass-end thread or the loop's
            route = self._routes.get(work.minibatch_id)
            if route is None:
                route = self._routes[work.minibatch_id] = self._route(work.plan)
                if len(self._routes) > 2:  # the current mini-batch's and the next one's
                    del self._routes[next(iter(self._routes))]
            return route

    # NOTE [ One pass ahead ]: what a pass needs before its first micro-batch starts ahead of
    # the loop, not when the loop first asks for it.
    # - Its prefetch iterator. ``next_pass`` queues the start of the pass's iterator on the
    #   rank's pass-end thread (after the previous pass's write-backs and close: NOTE
    #   [ Asynchronous pass ends ] in completion.py) and, for the mini-batch's next pass, the
    #   start of that pass's iterator too, with its take gated: it takes nothing until every
    #   micro-batch of the pass before it was taken from the ring (``PassWork.drained``: the
    #   earlier take's last lease, or ``done`` taking what the loop left). The ring's order is
    #   the schedule's, so the gated take cannot take a micro-batch of another pass, and each
    #   lease is checked to be the pass's (``PassTake``). So the next pass's thread is started
    #   while the current pass computes, and its first micro-batch is taken and staged as soon
    #   as the driver served it: for a pass that reads rollout fields only (reference log-probs
    #   after old), while the previous pass's last micro-batches compute; for one that reads
    #   written-back fields (train), once the write-backs are in, while the loop encodes and
    #   runs the dedup handshakes. ``micro_batches()`` hands out that iterator, or starts it if
    #   the pass-end thread has not yet (a lock makes it one start; none once the pass is
    #   finished). A thread start on the training thread waits until the new thread is
    #   scheduled and holds the GIL: 2-7 ms of wall time per pass on the loaded 2-core machine
    #   for 0.6 ms of CPU (``benchmarks/grpo_step.py``, profiled at de94463 and with the start
    #   moved to the pass-end thread at the pass's own start). A loop that never asks for the
    #   iterator ends the pass as one that never iterated (what was staged is released unread,
    #   with no error); one that stops short raises as before. A mini-batch's first pass starts
    #   at ``next_pass`` (its plan arrives with the schedule record); closing the handle stops a
    #   pass started ahead. Before, the iterator started after the encoder ran, so each pass's
    #   first micro-batch and the thread start were waited for in full.
    # - Its dedup route: every pass of a mini-batch encodes from the one plan, so the route
    #   (``RankHandle(route=...)``, e.g. ``MegatronLayout.route``: a routing plan for every
    #   rank of the encoder group) is built once per mini-batch and shared by its passes, not
    #   rebuilt per pass (``benchmarks/grpo_step.py`` profiled at de94463: 1.2 ms of a rank's
    #   main-thread CPU per build, 2.5-7 ms of wall time on rank 0, whose driver threads share
    #   its GIL; three builds per step). It is built on the pass-end thread right after the
    #   mini-batch's first encoding pass's prefetch starts (a lock makes it one build), so it
    #   overlaps the loop's waits; the route function must therefore be pure, as
    #   ``MegatronLayout.route`` is.
    # - Its encoder inputs: for a mini-batch's first pass that encodes, the same job then copies
    #   this rank's units out of the encoder ring into host memory (NOTE [ Encoder inputs once
    #   per mini-batch ]), instead of the loop waiting for them when it asks. A pass started
    #   ahead does not: its units may not be served before the current pass's write-backs are
    #   in, which the same thread publishes.
    # NOTE [ Passes inline ]: on CPU, a rank without ``convert`` iterates each pass inline
    # (NOTE [ Inline hand-out ] in knitkit/microbatch_iter/worker.py): ``PassTake`` has
    # ``next_lease``, which runs its checks (the lease's pass, the gate ``after``, the driver's
    # failure or death, ``drained``) with the ring's wait bounded by the iterator's
    # ``next_timeout_s``, so ``next()`` takes the lease on the loop's thread and no prefetch
    # thread starts. The look-ahead is the ring's: the reorganizer publishes the next pass's
    # first micro-batches into free slots as soon as the pass is served (NOTE [ Data ring
    # slots ] in driver.py); nothing takes them before the loop asks. A pass's iterator then
    # holds one lease, the loop's last, and ``done`` closes it at once on the loop's thread
    # (releasing that lease, no thread to join) instead of queueing the close on the pass-end
    # thread behind the pass's write-backs. The pass-end thread keeps what overlaps the loop:
    # write-back and ``done`` records, routes, encoder inputs, the schedule's next record.
    # A rank with ``convert`` keeps the prefetch thread, which converts ahead of the loop
    # (``MegatronRank``): moved onto the loop's thread (inline, converted in
    # ``data_iterator``), GRPO's conversion (~0.34 ms) and hand-out (~0.26 ms) per micro-batch
    # land in the loop's wait: ``benchmarks/grpo_step.py --quick``, 3 pairs against 058d322
    # (load 4.5-15): exposed wait, slowest rank, 3.1 -> 8.5, 2.8 -> 11.2, 13.1 -> 13.5 ms (mean
    # rank 1.7 -> 6.6, 1.5 -> 8.1, 5.5 -> 9.2) for ~200 fewer thread wakes per step, its CPU
    # within the noise. Re-decided with the conversion cut to 21 torch ops for a layout seen
    # before (NOTE [ Conversion by layout ] in integration/megatron/batch.py): thread against
    # inline, 6 back-to-back pairs (load 20-30), medians: mean rank's exposed wait 4.0 -> 6.8 ms
    # (higher inline in 5 of 6 pairs), ``batch`` 3.3 -> 6.5 ms, slowest rank 11.1 -> 11.3 ms,
    # CPU 0.590 -> 0.579 s per step: inline still raises the wait, so the thread stays.
    def iterate(self, work: PassWork) -> tuple[MicroBatchIterator, Taken]:
        """A prefetch iterator over exactly ``work``'s micro-batches of the data ring."""
        take = self._take(
            self._data, work.num_micro_batches, work, after=work.after, drained=work.drained
        )
        config = MicroBatchIterator.Config(
            depth=self.config.depth,
            slot_nbytes=self.config.slot_nbytes,
            next_timeout_s=self.config.next_timeout_s,
        )
        convert = functools.partial(self._convert, work) if self._convert is not None else None
        iterator = config.build(take, device=self.device, convert=convert, threads=self._threads)
        return iterator, take

    # NOTE [ Encoder inputs once per mini-batch ]: every encoding pass of a mini-batch (old
    # log-probs, reference, train) encodes the same unique units: the plan is one per mini-batch
    # and units are content-addressed, so their bytes cannot differ between passes. The rank
    # copies them out of its encoder ring in the first encoding pass and hands the same tensors
    # to the later ones at once, instead of waiting each time for its encoder reorganizer to
    # read and publish them again after the pass is served (``benchmarks/grpo_step.py --quick``,
    # "reading encoder inputs", slowest rank: 9.1 ms per step before, nearly all of it in the
    # train pass, 0.2 ms after; load ~7-10). So the driver serves the units once per
    # mini-batch, with its first encoding pass (``RankHandle.first_encoding``; ``Scheduler._step``
    # in serving.py); a later encoding pass carries no encoder micro-batches. It served them with
    # every encoding pass before, and each rank's pass-end thread took the later copies and
    # released them unread, its keys checked against the kept ones: per GRPO step two wasted
    # deliveries per encoder rank (an assignment through the submit thread, a compile, a
    # publication, a slot wait) and two takes and releases per rank, for bytes nobody read
    # (``benchmarks/grpo_step.py --quick`` at 1cebb89: 12 encoder deliveries per step, 4 after).
    # The rings still get every assignment in the schedule's order (an encoder ring's order is
    # the mini-batches'); a reorganizer restarted during a later pass has nothing of the
    # mini-batch left to re-serve (its units were published and the ranks keep them); the
    # store frees the units when the mini-batch is released, as before. The tensors are shared
    # by the passes: an in-place edit in one pass shows in the next (clone first). The first
    # encoding pass always takes them (its end reads them if the loop never asked), and they
    # are dropped after the last pass that encodes. The first encoding pass's copy to host
    # memory is taken by the pass-end thread as a mini-batch's first pass is handed out (NOTE
    # [ One pass ahead ]); the loop's thread moves them to the device when asked. Both threads
    # take from the encoder ring in the schedule's order, under ``_encoder``: the pass-end
    # thread copies only for a pass handed out now, whose units the driver serves with it.
    def read_encoder_inputs(self, work: PassWork) -> dict[UnitKey, torch.Tensor]:
        """This rank's encoder units of ``work``: those kept from the mini-batch's first
        encoding pass, else copied out of its encoder ring (see NOTE [ Encoder inputs once per
        mini-batch ])."""
        if work.unit_micro_batches() == 0 or self._units is None:
            return {}
        with self._encoder:
            if self._kept is None or self._kept[0] != work.minibatch_id:
                self.copy_encoder_inputs(work)  # served with the first encoding pass only
                if self._copied is None or self._copied[0] != work.minibatch_id:
                    raise RuntimeError(
                        f"rank {self.coords.rank}: pass {work.pass_.name!r} of "
                        f"{work.minibatch_id!r} asked for encoder inputs the rank no longer "
                        f"holds (they come with pass {self.first_encoding!r} and are dropped "
                        "after the last encoding pass); ask for them inside the pass"
                    )
                host, self._copied = self._copied[1], None
                device = self.device or "cpu"
                self._kept = (work.minibatch_id, {k: v.to(device) for k, v in host.items()})
            return dict(self._kept[1])

    def copy_encoder_inputs(self, work: PassWork) -> None:
        """Copy ``work``'s encoder units out of the encoder ring into host memory, unless the
        pass carries none or they were taken (the pass-end thread does it ahead for a
        mini-batch's first pass: NOTE [ One pass ahead ]; the loop's thread moves them to the
        device)."""
        count = work.encoder_micro_batches()
        with self._encoder:
            here = (work.minibatch_id, work.pass_.name)
            if count == 0 or self._units is None or self._units_taken == here:
                return
            out: dict[UnitKey, torch.Tensor] = {}
            for lease in self._take(self._units, count, work):
                with lease:
                    for key, view in lease.layout.unit_views(lease.buffer).items():
                        out[key] = torch.from_numpy(np.array(view))
            self._copied = (work.minibatch_id, out)
            self._units_taken = (work.minibatch_id, work.pass_.name)

    def end_pass(
        self, work: PassWork, iterator: MicroBatchIterator | None, take: Taken | None
    ) -> None:
        """Close the pass's iterator (adding its figures up), then take and release whatever
        of the pass the loop never read, so the rings stay in step with the schedule. A loop
        that read every micro-batch has this done on the pass-end thread (NOTE [ Asynchronous
        pass ends ] in completion.py); a short one raises here, as the ring is left."""
        self._cancel_peek()  # NOTE [ One mini-batch ahead ]
        if iterator is not None and iterator.stats.count == work.num_micro_batches:
            figures = iterator.metrics()
            for name in _ITERATOR_FIGURES:
                if name != _H2D:  # complete once the iterator is closed
                    self._totals[name] += figures[name]
            self._end_encoder(work)
            if self._inline:  # its last lease back now (NOTE [ Passes inline ])
                self._close_iterator(iterator)
                return
            self._ends.post(  # every lease is taken: closing releases the last one, joins
                f"closing pass {work.pass_.name!r} of {work.minibatch_id!r}",
                lambda: self._close_iterator(iterator),
                now=False,
            )
            return
        taken_by_loop = work.num_micro_batches
        if iterator is not None:
            self._ends.wait()  # a short pass: closed here, as the ring is left
            taken_by_loop = iterator.stats.count
            self._close_iterator(iterator, _ITERATOR_FIGURES)
        left = work.num_micro_batches - (take.taken if take is not None else 0)
        for lease in self._take(self._data, left, work):
            lease.release()
        work.drained.open()  # the next pass's take may start (NOTE [ One pass ahead ])
        self._end_encoder(work)
        if work.iterated and taken_by_loop < work.num_micro_batches:
            raise RuntimeError(
                f"rank {self.coords.rank}: pass {work.pass_.name!r} of {work.minibatch_id!r} "
                f"ended after {taken_by_loop} of its {work.num_micro_batches} micro-batches; "
                "train every micro-batch of a pass (every rank runs the same schedule)"
            )

    def pass_ended(self, work: PassWork, figures: Mapping[str, np.ndarray]) -> None:
        """The pass is finished: queue its ``done`` record (writer ranks) and let the pass-end
        thread run what the pass queued (NOTE [ Asynchronous pass ends ] in completion.py)."""
        self.send(work, "done", {}, figures)
        self._ends.release()

    def _close_iterator(
        self, iterator: MicroBatchIterator, figures: tuple[str, ...] = (_H2D,)
    ) -> None:
        """Close a pass's iterator (on either thread), then add its ``figures`` up."""
        iterator.close()
        closed = iterator.metrics()
        for name in figures:
            self._totals[name] += closed[name]

    def _end_encoder(self, work: PassWork) -> None:
        """The encoder ring moves on (see NOTE [ Encoder inputs once per mini-batch ]): the pass
        its units came with reads and keeps them if the loop never asked; the last encoding
        pass drops them."""
        if not work.pass_.encodes:
            return
        here = (work.minibatch_id, work.pass_.name)
        if work.encoder_micro_batches() and self._units is not None and self._units_taken != here:
            work.encoder_inputs()  # the first encoding pass never asked: read (and keep) them
        if work.pass_.name == self._last_encoding:
            with self._encoder:
                self._kept = None
                if self._copied is not None and self._copied[0] == work.minibatch_id:
                    self._copied = None  # copied ahead, never asked for

    def _take(
        self,
        ring: FollowingConsumer,
        count: int,
        work: PassWork,
        *,
        after: Gate | None = None,
        drained: Gate | None = None,
    ) -> PassTake:
        """Exactly ``count`` leases of ``work``'s assignment on ``ring``, checked to be its;
        ``after`` and ``drained`` as for ``DriverWatch.take``."""
        return self._watch.take(
            ring, count, pass_id(work.minibatch_id, work.pass_.name), after=after, drained=drained
        )

    def send(
        self,
        work: PassWork,
        kind: str,
        header: Mapping[str, str | int],
        arrays: Mapping[str, np.ndarray] | Callable[[], Mapping[str, np.ndarray]],
        *,
        at_once: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """One record to the driver (writer ranks): its arrays copied (or, given a function,
        built by it on the pass-end thread: NOTE [ Write-backs converted off the loop ] in
        work.py), then queued for the pass-end thread, which publishes it (NOTE [ Asynchronous
        pass ends ] in completion.py): at once, except ``values`` records, held for the pass's
        end unless ``at_once``; waits only while the queue is full (at most ``timeout_s``,
        default the spec's ``wait_timeout_s``)."""
        writer = self._writeback
        if writer is None:
            return
        self._cancel_peek()  # NOTE [ One mini-batch ahead ]
        full = {**self._record_header(work, kind), **header}
        if callable(arrays):
            build = arrays
        else:
            owned = {name: np.array(values, copy=True) for name, values in arrays.items()}
            build = functools.partial(dict, owned)
        self._ends.post(
            f"{kind} record of pass {work.pass_.name!r} of {work.minibatch_id!r}",
            lambda: self._publish(writer, full, build()),
            now=kind != "values" or at_once,  # values: with the pass's end or a full queue
            timeout_s=timeout_s,
        )

    def send_values(
        self, work: PassWork, records: Sequence[tuple[int, Callable[[], Mapping[str, np.ndarray]]]]
    ) -> None:
        """``values`` records of ``work`` (micro-batch index, its arrays' builder), queued as
        one pass-end job, held for the pass's end (NOTE [ Write-backs converted off the loop ]
        in work.py)."""
        writer = self._writeback
        if writer is None:
            return
        self._cancel_peek()  # NOTE [ One mini-batch ahead ]
        header = self._record_header(work, "values")

        def publish() -> None:
            for index, rows in records:
                self._publish(writer, {**header, "index": index}, rows())

        self._ends.post(
            f"{len(records)} values records of pass {work.pass_.name!r} of {work.minibatch_id!r}",
            publish,
            now=False,
        )

    def _record_header(self, work: PassWork, kind: str) -> dict[str, str | int]:
        """The header every record of ``work`` from this rank starts with."""
        return {
            "kind": kind,
            "mb": work.minibatch_id,
            "pass": work.pass_.name,
            "rank": self.coords.rank,
        }

    def token_counts(self, work: PassWork) -> list[int]:
        """Each of ``work``'s micro-batches' packed tokens on this rank, counted once per
        mini-batch (its passes pack alike)."""
        if self._token_counts is None or self._token_counts[0] != work.minibatch_id:
            counts = [mb.num_tokens for mb in work.consumer.micro_batches]
            self._token_counts = (work.minibatch_id, counts)
        return self._token_counts[1]

    def _publish(
        self,
        writer: RecordWriter,
        header: Mapping[str, str | int],
        arrays: Mapping[str, np.ndarray],
    ) -> None:
        """Publish one record (pass-end thread); a ring error means the driver is gone."""
        try:
            writer.send(header, arrays)
        except (RuntimeError, OSError) as error:
            raise DriverDiedError(
                f"rank {self.coords.rank}: cannot reach the driver ({error})"
            ) from None

    def _pass_end_failed(self, error: BaseException) -> None:
        """The pass-end thread failed (NOTE [ Asynchronous pass ends ] in completion.py): the
        driver hears of it through the failed write-back ring, the rank's waits on its data
        rings through its watch."""
        if self._writeback is not None:
            with contextlib.suppress(Exception):  # a ring the driver already left
                self._writeback.fail(
                    f"rank {self.coords.rank}'s pass-end thread failed: "
                    f"{type(error).__name__}: {error}"
                )
        self._watch.interrupt(error)

    def abandon(self, work: PassWork, error: BaseException, message: str) -> None:
        """The pass raised ``error``: tell the driver (writer ranks) ``message``, and whether a
        reorganizer's failure or death caused it (NOTE [ A rank's producer failure ] in
        core.py); leave the rings as they are."""
        if self._writeback is not None:
            header: dict[str, str | int] = {"message": message[-3000:]}
            if producer_failed(error):
                header["cause"] = PRODUCER_CAUSE
            with contextlib.suppress(Exception):
                self.send(work, "error", header, {}, timeout_s=_LEAVE_S)


@dataclass(slots=True)
class _Peeked:
    """What the look-ahead read (NOTE [ One mini-batch ahead ]): the schedule's next record
    (``None``: the driver finished), and, if it got that far, the plan and the started first
    pass."""

    record: Record | None
    opened: tuple[str, MiniBatchPlan] | None = None
    pass_plans: dict[str, MiniBatchPlan] = field(default_factory=dict)
    """The later passes' plans, restricted to their fields (off the training thread)."""
    work: PassWork | None = None


def _cuda_device(device: torch.device | str | None) -> torch.device | None:
    """The rank's CUDA device as its iterators resolve it (on the calling thread), or None."""
    resolved = torch.device(device) if device is not None else None
    if resolved is None and torch.cuda.is_available():
        resolved = torch.device("cuda")
    if resolved is None or resolved.type != "cuda":
        return None
    return (
        resolved
        if resolved.index is not None
        else torch.device("cuda", torch.cuda.current_device())
    )


def _on_device(device: torch.device | None) -> None:
    """Make ``device`` current on the calling thread (the pass-end thread closes iterators
    staged there: it must not touch another device's context)."""
    if device is not None:
        torch.cuda.set_device(device)


@contextlib.contextmanager
def _driver_rings(spec: RankSpec, rank: int) -> Iterator[None]:
    """Turn a driver ring missing at attach into ``DriverNotFoundError`` naming the cause."""
    try:
        yield
    except RingNotReadyError as missing:
        where = (
            f"Its schedule ring is on node {spec.nodes[rank]} (the control plane's placement of "
            f"rank {rank}, e.g. RayControl's): start the rank there while the driver runs"
            if spec.nodes
            else "Ranks must run on the driver's node, sharing its /dev/shm (containers: "
            "--ipc=host), while its driver runs (a closed driver has removed its rings); for "
            "ranks on other nodes build the driver with a control plane that reaches them "
            "(knitkit.integration.ray.RayControl)"
        )
        raise DriverNotFoundError(
            f"rank {rank}: the driver's rings are not in /dev/shm on this node "
            f"({socket.gethostname()}): {missing}. {where}"
        ) from None
