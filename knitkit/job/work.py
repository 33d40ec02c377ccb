"""One pass of one mini-batch on one rank: its plan, micro-batches, encoder inputs and write-back."""

from __future__ import annotations

import functools
import threading
import traceback
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np
import torch

from knitkit.encoder_dedup import RankRoute
from knitkit.job.errors import WriteBackMissingError
from knitkit.job.passes import Pass
from knitkit.job.watch import Gate
from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.storage import ConsumerPlan, MiniBatchPlan
from knitkit.types import UnitKey

if TYPE_CHECKING:
    from knitkit.job.rank import RankHandle, Taken

Route = Callable[[MiniBatchPlan], RankRoute]
"""Computes a rank's dedup route from a mini-batch plan (e.g. ``MegatronLayout.route``)."""


class PassWork:
    """What one rank does for one (mini-batch, pass): built by ``RankHandle.next_pass``.

    Use it as a context manager (or call ``done()``): leaving it checks that every micro-batch
    was taken and, on the group's writer rank, that every output was written back, then tells
    the driver the pass is finished, without waiting for the driver to take it (NOTE
    [ Asynchronous pass ends ] in completion.py). An exception inside the block reaches the
    driver too (writer ranks), so both sides fail with the rank's error.
    """

    def __init__(
        self,
        rank: RankHandle,
        minibatch_id: str,
        pass_: Pass,
        plan: MiniBatchPlan,
        *,
        after: Gate | None = None,
    ):
        """``after``: the previous pass's ``drained`` gate, when this pass's prefetch starts
        before that pass ends (NOTE [ One pass ahead ] in rank.py)."""
        self.minibatch_id = minibatch_id
        self.pass_ = pass_
        self.plan = plan
        """The mini-batch's one plan, restricted to this pass's fields."""
        self._rank = rank
        coords = rank.coords
        self.consumer: ConsumerPlan = plan.consumer(coords.dp, coords.cp)
        """This rank's (DP, CP) share, micro-batch by micro-batch."""
        self._iterator: MicroBatchIterator | None = None
        self._take: Taken | None = None
        self._inputs: dict[UnitKey, torch.Tensor] | None = None
        self._written: dict[int, set[str]] = {}
        self._sent = False
        """Whether a ``values`` record of this pass went to the driver."""
        self._held_records: list[tuple[int, Callable[[], dict[str, np.ndarray]]]] = []
        """``values`` records written back but not yet queued (NOTE [ Write-backs converted
        off the loop ])."""
        self._figures: dict[str, float] = {}
        self.finished = False
        self.iterated = False
        """Whether the loop asked for ``micro_batches()``."""
        self.after = after
        self.drained = Gate()
        """Opens once every micro-batch of the pass is taken from the ring (by its iterator,
        or by ``done`` for what the loop left): the next pass's take may start."""
        self._starting = threading.Lock()
        """Held while the iterator starts (on the rank's pass-end thread or the loop's): one
        start, none once the pass is finished (NOTE [ One pass ahead ] in rank.py)."""

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches of this pass on every rank (the same count on every DP rank)."""
        return len(self.consumer.micro_batches)

    @property
    def forward_only(self) -> bool:
        return self.pass_.forward_only

    @property
    def route(self) -> RankRoute:
        """This rank's encoder-dedup route for the mini-batch (``RankHandle(route=...)``),
        computed once per mini-batch: every pass gets the same one (NOTE [ One pass ahead ]
        in rank.py)."""
        return self._rank.route_of(self)

    def encoder_inputs(self) -> dict[UnitKey, torch.Tensor]:
        """The unique multimodal units this rank encodes in this pass, by key, on the rank's
        device (empty if it encodes none). Read from its encoder ring once per mini-batch, by
        its first encoding pass; later passes get the same tensors at once, so treat them as
        read-only (see NOTE [ Encoder inputs once per mini-batch ] in rank.py)."""
        if self._inputs is None:
            self._inputs = self._rank.read_encoder_inputs(self)
        return self._inputs

    def encoder_micro_batches(self) -> int:
        """How many encoder micro-batches this rank's encoder ring carries for this pass: the
        mini-batch's with its first encoding pass, none with a later one (NOTE [ Encoder inputs
        once per mini-batch ] in rank.py)."""
        if self.pass_.name != self._rank.first_encoding:
            return 0
        return self.unit_micro_batches()

    def unit_micro_batches(self) -> int:
        """How many encoder micro-batches of the mini-batch this rank encodes in this pass (0 if
        the pass does not encode or the rank holds no encoder rank)."""
        coords = self._rank.coords
        if not self.pass_.encodes or coords.encoder_rank is None:
            return 0
        encoder = self._rank.spec.encoders[0].name
        return len(self.plan.encoder(encoder).ranks[coords.encoder_rank].micro_batches)

    def micro_batches(self) -> MicroBatchIterator:
        """The pass's micro-batches, prefetched: exactly ``num_micro_batches`` from the rank's
        ring (``MicroBatchIterator`` over ``take``), never one of the next pass; each converted
        on the prefetch thread when the handle has ``convert``. Once per pass.
        Its prefetch started when the pass was handed out (NOTE [ One pass ahead ] in
        rank.py)."""
        if self.iterated:
            raise RuntimeError(
                f"pass {self.pass_.name!r} of {self.minibatch_id!r}: micro_batches() was already "
                "called; iterate the one iterator it returned"
            )
        self.prefetch()
        if self._iterator is None:
            raise RuntimeError(
                f"pass {self.pass_.name!r} of {self.minibatch_id!r} is finished; take "
                "micro_batches() inside the pass"
            )
        self.iterated = True
        return self._iterator

    def prefetch(self) -> None:
        """Start the pass's prefetch iterator (its thread takes and stages the first
        micro-batches) unless it runs or the pass is finished; ``RankHandle.next_pass`` has
        the rank's pass-end thread call it (NOTE [ One pass ahead ] in rank.py)."""
        with self._starting:
            if self._iterator is None and not self.finished:
                self._iterator, self._take = self._rank.iterate(self)

    def stop_prefetch(self) -> None:
        """Close the pass's iterator (stop its prefetch thread), if it runs: the pass is left."""
        iterator, _ = self._finish()
        if iterator is not None:
            iterator.close()

    def _finish(self) -> tuple[MicroBatchIterator | None, Taken | None]:
        """Mark the pass finished (no iterator starts after this); its iterator and take."""
        self.finished = True
        with self._starting:  # a start in progress on the pass-end thread completes first
            return self._iterator, self._take

    # NOTE [ Write-backs converted off the loop ]: ``write_back`` runs on the training thread,
    # inside the schedule (the example writes each micro-batch back from its loss function), so
    # its Python is exposed wait. ``benchmarks/grpo_step.py --quick`` (stop 49, load 6-20): a
    # writer rank's ``write_back`` 0.4-0.8 ms per step (4 calls; 0.4-0.5 ms of it the training
    # thread's CPU), the largest part of the slowest rank's wait on most quiet steps (non-writer
    # ranks: 0.07 ms). Each call converted the values to host rows of the declared dtype,
    # copied them, counted the micro-batch's tokens (a generator over its sequences) and queued
    # one pass-end job per record: 20-24 Python frames. Now it checks the fields and shapes
    # (errors still raise at the call), takes a snapshot (a host tensor's ``clone``, an array's
    # copy: the caller may reuse its tensor at once, as before; a device tensor is copied to
    # host rows here, on the caller's stream), and leaves the conversion to the pass-end thread.
    # A pass's first record that the next pass reads is queued at once (NOTE [ Serving as
    # write-backs arrive ] in serving.py); the others are held by the pass and queued as one
    # job at its end, before its iterator's close and ``done`` (the same order of records), or
    # once ``sends_ahead`` are held: 6 frames per held write-back
    # (tests/job/test_write_back_calls.py). Token counts are counted once per mini-batch (its
    # passes pack alike). A conversion that fails now fails the pass-end thread (the driver
    # hears the rank's error) instead of the call; a pass that raises drops what it holds (its
    # error record goes instead, as the driver fails the job with it).
    def write_back(self, index: int, values: Mapping[str, torch.Tensor | np.ndarray]) -> None:
        """Send micro-batch ``index``'s per-token outputs (one entry per field the pass writes):
        packed and CP-local as the micro-batch came, ``[T, *row]`` or ``[1, T, *row]``, padding
        included; cast to the declared dtype. Only the group's writer rank sends (TP rank 0 of
        the last stage); on other ranks this does nothing. Returns once the values are copied
        (NOTE [ Write-backs converted off the loop ]); the rank's pass-end thread converts and
        publishes them (it waits only while that queue is full)."""
        if not self._rank.writer:
            return
        writes = {o.name: o for o in self.pass_.writes}
        if values.keys() != writes.keys():
            raise ValueError(
                f"pass {self.pass_.name!r} writes {sorted(writes)}; write_back got "
                f"{sorted(values)} for micro-batch {index}"
            )
        if not 0 <= index < self.num_micro_batches:
            raise IndexError(
                f"micro-batch {index} outside pass {self.pass_.name!r}'s "
                f"{self.num_micro_batches} micro-batches"
            )
        tokens = self._rank.token_counts(self)[index]
        held: dict[str, _Held] = {}
        for name, value in values.items():
            expected = (tokens, *writes[name].row_shape)
            got = tuple(value.shape)
            if got != expected and got != (1, *expected):
                raise ValueError(
                    f"pass {self.pass_.name!r}, micro-batch {index}, field {name!r}: got shape "
                    f"{got}, expected {expected} (one row per packed token of this rank, "
                    "padding included; [1, T, ...] too)"
                )
            held[name] = (_held(value, writes[name].dtype), writes[name].dtype, expected)
        if self.consumer.micro_batches[index].sequences:
            # NOTE [ Serving as write-backs arrive ] in serving.py: the first goes at once
            rows = functools.partial(_records_rows, held)
            if not self._sent and self.pass_.name in self._rank.read_next:
                self._rank.send(self, "values", {"index": index}, rows, at_once=True)
            else:  # with the pass's end (NOTE [ Write-backs converted off the loop ])
                self._held_records.append((index, rows))
                if len(self._held_records) >= self._rank.config.sends_ahead:
                    self._send_held()
            self._sent = True
        self._written.setdefault(index, set()).update(held)

    def _send_held(self) -> None:
        """Queue the ``values`` records held so far as one pass-end job."""
        held, self._held_records = self._held_records, []
        if held:
            self._rank.send_values(self, held)

    def report(self, figures: Mapping[str, float]) -> None:
        """Figures (``knitkit/...`` names) to hand the driver with this pass's end (writer
        ranks; the driver sums them over groups and passes for its observer)."""
        self._figures.update({k: float(v) for k, v in figures.items()})

    def done(self) -> None:
        """Finish the pass: check the micro-batches and write-backs, then hand the rest (closing
        the iterator, releasing what is left, telling the driver) to the rank's pass-end thread
        and return (a failed check reaches the driver as the rank's error). Idempotent."""
        if self.finished:
            return
        iterator, take = self._finish()
        try:
            self._send_held()  # before the iterator's close and ``done``, as written
            self._rank.end_pass(self, iterator, take)
            self._check_written()
        except BaseException as error:
            self._rank.abandon(self, error, f"{type(error).__name__}: {error}")
            raise
        figures = {k: np.array([v], np.float64) for k, v in self._figures.items()}
        self._rank.pass_ended(self, figures)

    def _check_written(self) -> None:
        """On the writer rank: every micro-batch with tokens got every output of the pass."""
        if not (self._rank.writer and self.pass_.writes):
            return
        lacking = {
            o.name: [
                mb.index
                for mb in self.consumer.micro_batches
                if mb.sequences and o.name not in self._written.get(mb.index, set())
            ]
            for o in self.pass_.writes
        }
        lacking = {name: v for name, v in lacking.items() if v}
        if lacking:
            raise WriteBackMissingError(
                f"rank {self._rank.coords.rank} finished pass {self.pass_.name!r} of "
                f"{self.minibatch_id!r} without writing back micro-batches {lacking}"
            )

    def __enter__(self) -> PassWork:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.done()
            return
        if not self.finished:
            self.stop_prefetch()  # the rank is failing anyway
            message = "".join(traceback.format_exception(exc_type, exc, tb))
            self._rank.abandon(self, exc, message)


_Held = tuple[torch.Tensor | np.ndarray, str, tuple[int, ...]]
"""A written field's snapshot, its declared dtype and its ``[T, *row]`` shape."""


def _held(value: torch.Tensor | np.ndarray, dtype: str) -> torch.Tensor | np.ndarray:
    """``value``'s snapshot for its record (NOTE [ Write-backs converted off the loop ]): a
    host tensor's clone or an array's copy, converted later; a device tensor as host rows now."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value.clone() if value.device.type == "cpu" else _rows(value, dtype)
    return np.array(value, copy=True)


def _records_rows(held: Mapping[str, _Held]) -> dict[str, np.ndarray]:
    """Pass-end thread: a ``values`` record's arrays, ``[T, *row]`` host rows of their dtypes."""
    return {
        name: _rows(value, dtype).reshape(shape) for name, (value, dtype, shape) in held.items()
    }


def _rows(value: torch.Tensor | np.ndarray, dtype: str) -> np.ndarray:
    """``value`` as a host numpy array of ``dtype`` (bfloat16 tensors go through float32)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype == torch.bfloat16:
            value = value.float()
        value = value.cpu().numpy()
    return np.ascontiguousarray(np.asarray(value).astype(dtype, copy=False))
