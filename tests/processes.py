"""Bounded waits for the tests that start and stop processes: a condition, a process gone, and
the clean-up of what a failed test left running."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable

BOUND_S = 60.0
"""Default bound on a wait: generous, so a loaded machine passes too."""


def wait_until(condition: Callable[[], bool], what: str, bound_s: float = BOUND_S) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` if it does not within ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {bound_s} s: {what}"
        time.sleep(0.01)


def gone(pid: int) -> bool:
    """Whether no process has ``pid`` any more (a zombie still counts: its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def kill_left(pids: Iterable[int]) -> None:
    """SIGKILL whichever of ``pids`` still run: a test's clean-up, so that a failure leaves no
    process behind (one that ended meanwhile is skipped, with no check-then-kill race)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
