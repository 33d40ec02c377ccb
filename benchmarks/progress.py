"""One progress line on stderr per finished phase of a benchmark; stdout keeps the tables."""

from __future__ import annotations

import sys
import time


class Progress:
    """``progress("sliced reads")`` prints ``[transfer   12.3 s] sliced reads`` to stderr."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = time.perf_counter()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.started
        print(f"[{self.name} {elapsed:7.1f} s] {message}", file=sys.stderr, flush=True)
