"""ProgressLine: an observer that prints one progress line per step, with an estimate of the time left."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ProgressLine:
    """``step 3/12 (25%) 14 s, ~20 s left: loss 4.12, units live 96`` for long commands.

    ``show`` maps a short label to the figure printed after it (skipped while absent). The time
    left is estimated from the steps after the first (the first also pays for start-up).
    """

    def __init__(
        self,
        total: int,
        show: Mapping[str, str] | None = None,
        *,
        say: Callable[[str], None] = to_stderr,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if total < 1:
            raise ValueError(f"ProgressLine(total={total}): a run has at least one step")
        self.total, self.show, self.say, self.clock = total, dict(show or {}), say, clock
        self.done = 0
        self.started = clock()
        self._first = 0.0

    def __call__(self, step: int, metrics: Mapping[str, float], /) -> None:
        now = self.clock()
        self.done += 1
        if self.done == 1:
            self._first = now
        left = ""
        if 1 < self.done < self.total:
            per_step = (now - self._first) / (self.done - 1)
            left = f", ~{per_step * (self.total - self.done):.0f} s left"
        figures = ", ".join(
            f"{label} {metrics[name]:.4g}" for label, name in self.show.items() if name in metrics
        )
        self.say(
            f"step {self.done}/{self.total} ({self.done / self.total:.0%}) "
            f"{now - self.started:.0f} s{left}{': ' + figures if figures else ''}"
        )
