"""Polling schedule for processes that share a slot ring: how long to sleep, when to check liveness."""

from __future__ import annotations

import time


class Backoff:
    """Sleep schedule for polling a shared word: spin briefly, then sleep up to ``max_s``.

    NOTE [ Liveness checks off the poll path ]: a waiting loop polls a shared word every
    20 us .. 1 ms, but a liveness check reads ``/proc`` (tens of us per pid). Run per poll, six
    reorganizers waiting on their consumers' releases spent a large part of a core on it, and a
    consumer paid it between publication and hand-off. Loops check liveness only when
    ``check_due()`` says so: after ``check_every_s`` of waiting, then once per period, so a death
    is still seen within a period plus a poll.
    """

    def __init__(self, max_s: float = 0.001, check_every_s: float = 0.01):
        self._delay = 0.0
        self._max = max_s
        self._every = check_every_s
        self._check_at = time.monotonic() + check_every_s

    def check_due(self) -> bool:
        """True once per ``check_every_s`` of waiting, never before the first period ends."""
        now = time.monotonic()
        if now < self._check_at:
            return False
        self._check_at = now + self._every
        return True

    def wait(self) -> None:
        if self._delay:
            time.sleep(self._delay)
        self._delay = min(self._max, self._delay * 2 or 2e-5)
