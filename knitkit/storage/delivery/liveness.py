"""Polling helpers for processes that share a slot ring: is a pid alive, how long to sleep."""

from __future__ import annotations

import time


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs on this node and is not a zombie."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


class Backoff:
    """Sleep schedule for polling a shared word: spin briefly, then sleep up to ``max_s``."""

    def __init__(self, max_s: float = 0.001):
        self._delay = 0.0
        self._max = max_s

    def wait(self) -> None:
        if self._delay:
            time.sleep(self._delay)
        self._delay = min(self._max, self._delay * 2 or 2e-5)
