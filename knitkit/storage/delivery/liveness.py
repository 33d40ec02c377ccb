"""Wait slices for processes that share a slot ring: how long to block, when to check liveness."""

from __future__ import annotations

import math
import time

CHECK_EVERY_S = 0.25
"""Liveness period of a waiting loop: a death (or a stop request) is seen within one period.
Each wake costs a waiter ~0.1 ms of CPU (a thread switch, /proc reads): 4 a second keep an idle
producer or consumer near 0.1 % of a core (issue 23). A consumer with a liveness timeout under
four periods checks four times per timeout instead (``MicroBatchConsumer``)."""
LONGEST_CHECK_S = 2.0
"""Longest liveness period of a wait that backs off (a rank's waits on its rings: NOTE
[ Liveness checks back off ])."""


class WaitSlices:
    """The schedule of one waiting loop: block in slices that end at the next liveness check.

    NOTE [ Liveness checks off the poll path ]: a waiting loop blocks on a shared word (NOTE
    [ Futex waits ] in atomic_words.py) and is woken by the store it waits for, but a liveness
    check reads ``/proc`` (tens of us per pid) and no store announces a death. Loops check
    liveness only when ``check_due()`` says so: after ``check_every_s`` of waiting, then once
    per period, and block at most until the next check (``slice_s``), so a death is seen within
    a period and a waiter that is never woken still wakes once per period, not per poll.
    """

    def __init__(
        self,
        timeout_s: float = math.inf,
        check_every_s: float = CHECK_EVERY_S,
        *,
        longest_s: float | None = None,
    ):
        """``longest_s``: the period doubles after each check up to it (NOTE [ Liveness checks
        back off ]); None keeps ``check_every_s``."""
        now = time.monotonic()
        self.deadline = now + timeout_s
        self._every = check_every_s
        self._longest = check_every_s if longest_s is None else max(check_every_s, longest_s)
        self._check_at = now + check_every_s

    def check_due(self) -> bool:
        """True once per period of waiting, never before the first period ends."""
        now = time.monotonic()
        if now < self._check_at:
            return False
        self._every = min(2 * self._every, self._longest)
        self._check_at = now + self._every
        return True

    @property
    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def slice_s(self) -> float:
        """How long the next blocking wait may sleep: until the next check or the deadline."""
        return max(0.0, min(self._check_at, self.deadline) - time.monotonic())


# NOTE [ Liveness checks back off ]
#
# A rank's waits on its rings (``MicroBatchConsumer`` for the next micro-batch, ``ProducerWatch``
# on its driver) check liveness after CHECK_EVERY_S, then at periods that double up to
# LONGEST_CHECK_S (and never past a quarter of the liveness timeout, so a stalled heartbeat is
# still seen within 1.25 timeouts). Each check is a wake with nothing to do but look: ~170 us of
# CPU on the 2-core dev box under load (a waiting consumer, 12 wakes in 3 s cost 2.0 ms of thread
# time; RANK31's scratch measurement, issue 31), paid by every TP rank whose prefetch thread
# waits through its step's compute. A wait that ends within 0.25 s (the usual one: the next
# publication is a copy away) makes no check at all, as before; a long one (a rank waiting for
# its next pass, for generation, for a slow peer) makes one check per 2 s instead of four per
# second: 12 wakes in 3 s become 3. The price: a producer's death during a long wait is seen up
# to 2 s after it happens instead of 0.25 s. That is the trade a senior engineer takes: a dead
# reorganizer stops the whole job, whose restart takes minutes, so 1.75 s more to notice it is
# noise, while the wakes are paid on every rank during every healthy wait. Death during a short
# wait is still seen within 0.25 s; closes, interrupts, failures and the end of a stream wake
# the waiter at once (NOTE [ Futex waits ] in atomic_words.py). The producer's own waits keep
# the fixed period: it beats its heartbeat at every slice, which consumers judge it by.
