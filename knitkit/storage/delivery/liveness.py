"""Wait slices for processes that share a slot ring: how long to block, when to check liveness."""

from __future__ import annotations

import math
import time

CHECK_EVERY_S = 0.25
"""Liveness period of a waiting loop: a death (or a stop request) is seen within one period.
Each wake costs a waiter ~0.1 ms of CPU (a thread switch, /proc reads): 4 a second keep an idle
producer or consumer near 0.1 % of a core (issue 23). A consumer with a liveness timeout under
four periods checks four times per timeout instead (``MicroBatchConsumer``)."""


class WaitSlices:
    """The schedule of one waiting loop: block in slices that end at the next liveness check.

    NOTE [ Liveness checks off the poll path ]: a waiting loop blocks on a shared word (NOTE
    [ Futex waits ] in atomic_words.py) and is woken by the store it waits for, but a liveness
    check reads ``/proc`` (tens of us per pid) and no store announces a death. Loops check
    liveness only when ``check_due()`` says so: after ``check_every_s`` of waiting, then once
    per period, and block at most until the next check (``slice_s``), so a death is seen within
    a period and a waiter that is never woken still wakes once per period, not per poll.
    """

    def __init__(self, timeout_s: float = math.inf, check_every_s: float = CHECK_EVERY_S):
        now = time.monotonic()
        self.deadline = now + timeout_s
        self._every = check_every_s
        self._check_at = now + check_every_s

    def check_due(self) -> bool:
        """True once per ``check_every_s`` of waiting, never before the first period ends."""
        now = time.monotonic()
        if now < self._check_at:
            return False
        self._check_at = now + self._every
        return True

    @property
    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def slice_s(self) -> float:
        """How long the next blocking wait may sleep: until the next check or the deadline."""
        return max(0.0, min(self._check_at, self.deadline) - time.monotonic())
