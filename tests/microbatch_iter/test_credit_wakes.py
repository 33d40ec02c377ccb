"""A prefetch thread that is ahead is woken once per two hand-overs at depth 2, not per hand-over
(NOTE [ Credits kept while ahead ] in knitkit/microbatch_iter/worker.py; issue 31's hand-over
overhead in benchmarks/prefetch.py)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from types import FrameType

import numpy as np

from knitkit.microbatch_iter import MicroBatchIterator

BOUND_S = 60.0
COUNT = 24


def _source() -> Iterator[dict[str, np.ndarray]]:
    for index in range(COUNT):
        yield {"x": np.full(16, index, np.int64)}


def test_a_thread_ahead_sleeps_for_a_credit_once_per_two_hand_overs() -> None:
    """Each ``next()`` is asked while the thread sleeps for a credit with everything it may
    stage queued (so the counts do not depend on the machine's load): over 20 hand-overs the
    thread enters 10 sleeps for a credit, one per two micro-batches (on d1b4542: 20, one per
    micro-batch), and every micro-batch arrives in order."""
    sleeping = [False]
    sleeps = [0]

    def profile(frame: FrameType, event: str, arg: object) -> None:
        """On the prefetch thread: its blocking gets of a ``SimpleQueue`` (its credits')."""
        if (
            event in ("c_call", "c_return")
            and getattr(arg, "__name__", "") == "get"
            and type(getattr(arg, "__self__", None)) is queue.SimpleQueue
        ):
            sleeping[0] = event == "c_call"
            sleeps[0] += event == "c_call"

    threading.setprofile(profile)  # threads started from now on: the prefetch thread
    try:
        it = MicroBatchIterator(_source(), MicroBatchIterator.Config(depth=2), device="cpu")
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    with it:
        credits = it._prefetcher.credits

        def asleep_for_a_credit() -> None:
            deadline = time.monotonic() + BOUND_S
            while not (sleeping[0] and credits.empty()):
                assert time.monotonic() < deadline, "the prefetch thread never slept for a credit"
                time.sleep(0.001)

        asleep_for_a_credit()
        assert int(next(it)["x"][0]) == 0
        asleep_for_a_credit()
        before = sleeps[0]
        for index in range(1, 21):
            assert int(next(it)["x"][0]) == index
            asleep_for_a_credit()
        assert sleeps[0] - before <= 11, sleeps[0] - before
        assert [int(batch["x"][-1]) for batch in it] == list(range(21, COUNT))
