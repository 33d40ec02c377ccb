"""Where a rank's step time goes: the data path's waits by kind, wall time, CPU, bytes read."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


class StepClock:
    """One rank's time in the data path during a step: every wait for a pass, a batch, encoder
    inputs or a write-back, and each micro-batch's ``next()``; the rest of the step computes.

    ``probe`` returns cumulative figures of this rank (e.g. other processes' CPU seconds, bytes
    read): each step reports their change. ``bytes_read`` is added to by a loop that reads
    data itself (the plain loop).
    """

    def __init__(self, probe: Callable[[], dict[str, float]] | None = None) -> None:
        self.waits: dict[str, float] = {}
        """Data-path seconds of the step by kind (``pass``, ``batch``, ``write_back``, ...)."""
        self.bytes_read = 0
        self._probe = probe
        self._start: dict[str, float] = {}

    def start(self) -> None:
        self.waits, self.bytes_read = {}, 0
        probed = self._probe() if self._probe is not None else {}
        self._start = self._clocks() | probed  # the probe's own time stays out of the step

    def stop(self) -> dict[str, float]:
        """The step's figures: data-path wait, wall time, this process's CPU (all threads; and
        its main thread's alone), bytes read and the probe's, all as changes over the step
        (the clocks are read after the start's probe and before the stop's)."""
        end = self._clocks()
        end |= self._probe() if self._probe is not None else {}
        out = {name: end[name] - self._start.get(name, 0.0) for name in end}
        waits = {f"data_wait_s.{kind}": s for kind, s in self.waits.items()}
        total = {"data_wait_s": sum(self.waits.values()), "bytes_read": float(self.bytes_read)}
        return total | waits | out

    def _clocks(self) -> dict[str, float]:
        return {
            "wall_s": time.perf_counter(),
            "cpu_s": time.process_time(),
            "main_thread_cpu_s": time.thread_time(),
        }

    @contextlib.contextmanager
    def data(self, kind: str) -> Iterator[None]:
        """Count the block as data-path time of ``kind``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.waits[kind] = self.waits.get(kind, 0.0) + time.perf_counter() - start

    def timed(self, batches: Iterable[T], first: str = "batch") -> Iterator[T]:
        """``batches`` with each ``next()`` counted as data-path time of kind ``batch``, the
        first one's as ``first`` (a pass's first micro-batch: the one that waits for what an
        earlier pass wrote back)."""
        source = iter(batches)
        kind = first
        while True:
            with self.data(kind):
                batch = next(source, None)
            if batch is None:
                return
            kind = "batch"
            yield batch
