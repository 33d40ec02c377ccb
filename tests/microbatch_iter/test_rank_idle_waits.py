"""The training loop's wait in ``next()`` sleeps until its record arrives or its deadline, with
no periodic wakes in between (issue 31; ``_ANNOUNCED_WAIT_S`` in worker.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from task_switches import voluntary_switches

from knitkit.microbatch_iter import MicroBatchIterator

_THIS_THREAD = "/proc/thread-self/status"


def _voluntary_switches() -> int:
    """This thread's voluntary context switches so far (each sleep that ended is one)."""
    return voluntary_switches(_THIS_THREAD)[_THIS_THREAD]


def test_a_waiting_next_makes_no_periodic_wakes():
    """next() over a source that yields nothing for its whole 1 s deadline sleeps through it:
    at most a few wakes (a poll every 0.1 s made ten), then TimeoutError at the deadline."""
    gate = threading.Event()

    def stuck():
        gate.wait()
        yield {"x": np.zeros(1)}

    config = MicroBatchIterator.Config(next_timeout_s=1.0, join_timeout_s=5.0)
    it = MicroBatchIterator(stuck(), config, device="cpu")
    try:
        before = _voluntary_switches()
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"next_timeout_s=1\.0"):
            next(it)
        waited = time.monotonic() - start
        wakes = _voluntary_switches() - before
        assert waited >= 1.0
        assert wakes <= 4, f"{wakes} wakes in {waited:.2f} s of waiting"
    finally:
        gate.set()
        it.close()
