"""Bounded waits for the tests that start and stop processes: a condition, a process gone."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

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
