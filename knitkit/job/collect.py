"""A collector thread per (DP, CP) group: its writer rank's outputs into the store, its pass ends into the ledger."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from knitkit.job.control import WriteBackSource
from knitkit.job.core import JobCore
from knitkit.job.errors import PRODUCER_CAUSE, RankFailedError, WriteBackMissingError
from knitkit.job.ledger import MiniBatchLedger
from knitkit.job.passes import Pass
from knitkit.job.records import Record
from knitkit.job.write_back import parse_placed
from knitkit.metrics import merge, sum_over
from knitkit.storage import ReorganizerDiedError, ReorganizerError
from knitkit.storage.delivery import ConsumerClosedError, RingNotReadyError

ATTACH_POLL_S = 0.05
"""How often a collector looks for its writer rank's ring before the rank has created it."""


class Collector:
    """Drains one group's write-back ring (see NOTE [ Driver threads ] in driver.py).

    A ``values`` record is one micro-batch's outputs in packed CP-local order: the plan's
    ``unpack`` undoes packing and the CP split, the store's ``write_ranges`` writes them; one
    whose outputs a relay placed on the writer's node already carries only what was placed,
    which the store adopts (NOTE [ Write-backs stay on the writer's node ]). A
    ``done`` record ends the group's pass (checked complete); after the last pass the group's
    units are queued to be freed (``JobCore.free_published``), and after the last group the
    mini-batch is released and its figures queued for the observer. An ``error`` record, the
    writer rank's death, or no writer rank attached within ``attach_timeout_s`` of the first
    pass served, fails the job.
    """

    def __init__(
        self, core: JobCore, group: str, source: WriteBackSource, attach_timeout_s: float
    ) -> None:
        self.core, self.group, self.source = core, group, source
        self.attach_timeout_s = attach_timeout_s
        self.thread = threading.Thread(
            target=self._run, name=f"knitkit-driver-{group}", daemon=True
        )

    def close(self) -> None:
        """Make the thread leave (a wait for the next record raises at once)."""
        self.source.close()

    def _run(self) -> None:
        core = self.core
        try:
            if not self._attach():
                return
            while self._collect():
                pass
        except BaseException as error:
            if not core.stopping.is_set():
                core.part_failed(error)

    # NOTE [ A pass's records in one wake ]: a writer rank's pass-end thread publishes a pass's
    # ``values`` records back to back (held until the pass ends: NOTE [ Asynchronous pass ends ]
    # in completion.py), and the group's next pass is served only once the last of them is
    # applied (NOTE [ Next pass per group ] in serving.py). Applied one per wake, each record cost
    # a lock hold and a ``notify_all`` waking the scheduler to find the group not ready yet, on
    # rank 0's GIL. So the collector waits for one record, takes every record already published
    # after it without waiting (``next(0)``), and applies them in order under one lock hold with
    # one ``notify_all``. Order, exactly-once and the checks are as before; records taken before
    # the source fails (the rank's error or death) are applied before that is raised.
    # Measured (``benchmarks/grpo_step.py --quick``, 11 back-to-back pairs, load 12-31): the
    # scheduler thread's wakes per step 32 -> 22.5 (medians); the latency from a group's first
    # reference record to its train pass served did not move (traced, ~3.9 ms both), nor did the
    # exposed wait: the path's larger part is the reorganizer's (serve to first lease, 2-28 ms).

    def _collect(self) -> bool:
        """Wait for the next record, take the ones published after it, apply them (see NOTE
        [ A pass's records in one wake ]); False once the writer finished or the source closed."""
        records: list[Record] = []
        try:
            while (record := self._next(0.0 if records else math.inf)) is not None:
                records.append(record)
            return False
        except TimeoutError:
            return True
        except ConsumerClosedError:
            return False
        finally:
            if records:
                with self.core.lock:
                    self.core.ledger.counts["write_back_wakes"] += 1
                    for taken in records:
                        self._apply(taken)
                    self.core.lock.notify_all()

    def _next(self, timeout_s: float) -> Record | None:
        """The source's next record (``None`` once the writer finished, or once the driver
        stops and the source fails with it); ``RankFailedError`` naming the writer rank."""
        try:
            return self.source.next(timeout_s)
        except (ReorganizerDiedError, ReorganizerError) as error:
            if self.core.stopping.is_set():
                return None
            raise RankFailedError(
                f"the writer rank of {self.group} stopped: {error}; restart the job's ranks"
            ) from error

    def _attach(self) -> bool:
        """The writer rank creates its ring when it starts: wait for it (until stopped), at most
        ``attach_timeout_s`` once the schedule holds work for the ranks."""
        core = self.core
        deadline = math.inf
        while not core.stopping.is_set():
            try:
                self.source.attach()
            except RingNotReadyError as missing:  # NOTE [ Ring role locks ] in slot_ring.py
                if deadline == math.inf and core.schedule.published:
                    deadline = time.monotonic() + self.attach_timeout_s
                if time.monotonic() > deadline:
                    raise self._none_attached(missing) from None
                core.stopping.wait(ATTACH_POLL_S)
                continue
            except ConsumerClosedError:
                return False
            return not core.stopping.is_set()
        return False

    def _none_attached(self, missing: RingNotReadyError) -> RankFailedError:
        schedule = self.core.schedule
        return RankFailedError(
            f"no rank attached to {self.group} within attach_timeout_s={self.attach_timeout_s} "
            "s of the first pass served: its writer rank (TP 0 of the last pipeline stage) "
            f"never created its write-back ring ({missing}); ranks attached to the schedule: "
            f"{schedule.readers_attached()} of {schedule.readers}. Start every rank with this "
            "driver's rank_spec() where its control plane reaches it (LocalControl, the "
            "default: on the driver's node, sharing its /dev/shm; RayControl: on the node its "
            "placement names)"
        )

    def _apply(self, record: Record) -> None:
        """One record from the group's writer rank (under the lock; the caller notifies)."""
        core, header = self.core, record.header
        kind = header.get("kind")
        if kind == "error":
            raise RankFailedError(
                f"rank {header.get('rank')} ({self.group}) failed in pass {header.get('pass')!r} "
                f"of mini-batch {header.get('mb')!r}:\n{header.get('message')}",
                producer_failed=header.get("cause") == PRODUCER_CAUSE,
            )
        ledger = core.ledger.minibatches.get(str(header.get("mb")))
        pass_ = next((p for p in core.passes if p.name == header.get("pass")), None)
        if ledger is None or pass_ is None or not ledger.passes[pass_.name].served_to_any:
            raise RankFailedError(
                f"{self.group} sent a {kind!r} record for pass {header.get('pass')!r} of "
                f"mini-batch {header.get('mb')!r}, which is not being served"
            )
        if kind == "values" and "placed" in header:
            self._adopt(ledger, pass_, int(header["index"]), header)
        elif kind == "values":
            self._store(ledger, pass_, int(header["index"]), record.arrays)
        elif kind == "done":
            self._done(ledger, pass_, {k: float(v[0]) for k, v in record.arrays.items()})
        else:
            raise RankFailedError(f"{self.group} sent a record of unknown kind {kind!r}")

    def _store(
        self, ledger: MiniBatchLedger, pass_: Pass, index: int, arrays: Mapping[str, np.ndarray]
    ) -> None:
        """Write one micro-batch's outputs into the stored trajectories (packing undone)."""
        core = self.core
        self._check_fields(pass_, arrays)
        consumer = next(c for c in ledger.plan.consumers if c.name == self.group)
        micro_batch = consumer.micro_batches[index]
        for name, rows in arrays.items():
            for piece in micro_batch.unpack(rows):
                core.store.write_ranges(piece.trajectory_id, name, piece.ranges, piece.rows)
        self._received(ledger, pass_, index, {k: int(v.nbytes) for k, v in arrays.items()})

    def _received(
        self, ledger: MiniBatchLedger, pass_: Pass, index: int, sizes: Mapping[str, int]
    ) -> None:
        """Micro-batch ``index``'s outputs are in the store: ``sizes`` bytes per field."""
        core = self.core
        for name, size in sizes.items():
            ledger.passes[pass_.name].received[name].setdefault(self.group, set()).add(index)
            core.ledger.counts["write_back_bytes"] += size
        core.ledger.counts["write_back_records"] += 1

    def _adopt(
        self, ledger: MiniBatchLedger, pass_: Pass, index: int, header: Mapping[str, Any]
    ) -> None:
        """One micro-batch's outputs, placed on the writer's node by its relay: index the units
        it completed (see NOTE [ Write-backs stay on the writer's node ] in write_back.py)."""
        core = self.core
        try:
            units, sizes = parse_placed(header)
        except ValueError as error:
            raise RankFailedError(f"{self.group}: {error}") from None
        self._check_fields(pass_, sizes)
        try:
            core.store.adopt_written(units, placed_on=str(header.get("node", "")))
        except (KeyError, ValueError) as error:
            raise RankFailedError(
                f"{self.group}'s write-back of micro-batch {index}, pass {pass_.name!r} of "
                f"mini-batch {ledger.minibatch_id!r}, placed on node {header.get('node')}: "
                f"{error}"
            ) from None
        self._received(ledger, pass_, index, sizes)

    def _check_fields(self, pass_: Pass, fields: Collection[str]) -> None:
        """A record carries exactly the outputs ``pass_`` writes."""
        expected = {o.name for o in pass_.writes}
        if set(fields) != expected:
            raise RankFailedError(
                f"{self.group} wrote back {sorted(fields)} for pass {pass_.name!r}, which writes "
                f"{sorted(expected)}"
            )

    def _done(self, ledger: MiniBatchLedger, pass_: Pass, figures: dict[str, float]) -> None:
        """The group finished ``pass_``: check its outputs, note it, free what is done."""
        core = self.core
        lacking = {
            o.name: indices
            for o in pass_.writes
            if (indices := ledger.lacking(o.name, pass_).get(self.group))
        }
        if lacking:
            raise WriteBackMissingError(
                f"{self.group} finished pass {pass_.name!r} of mini-batch {ledger.minibatch_id!r} "
                f"without outputs for micro-batches {lacking}"
            )
        state = ledger.passes[pass_.name]
        state.done.add(self.group)
        state.figures[self.group] = figures
        if ledger.consumed(pass_.name):
            core.ledger.counts["passes_consumed"] += 1
        if pass_ is core.passes[-1]:
            self._release(ledger)

    def _release(self, ledger: MiniBatchLedger) -> None:
        """The group finished the last pass: its units are to be freed; after the last group,
        the rest of the mini-batch's, and its figures queued for the observer. The scheduler
        frees them once their reorganizers published the mini-batch (``free_published``)."""
        core = self.core
        core.unfreed.append((ledger.minibatch_id, self.group))
        ledger.store_consumers.discard(self.group)
        if not ledger.consumed(core.passes[-1].name):
            return
        core.unfreed.extend((ledger.minibatch_id, name) for name in sorted(ledger.store_consumers))
        ledger.store_consumers.clear()
        del core.ledger.minibatches[ledger.minibatch_id]
        core.ledger.released += 1
        ranks = [f for p in ledger.passes.values() for f in p.figures.values()]
        core.ledger.to_observe.append(
            merge(
                ledger.admission_figures,
                core.parts_metrics(),
                core.job_metrics(),
                sum_over(ranks),
            )
        )
