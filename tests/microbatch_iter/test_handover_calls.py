"""With a prefetch thread, ``next()`` hands over a micro-batch the thread built ahead: the loop's
thread makes a few calls per micro-batch and builds no object (NOTE [ Micro-batches built ahead ]
in knitkit/microbatch_iter/worker.py; issue 31's hand-over overhead in benchmarks/prefetch.py)."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Iterator
from types import FrameType

import numpy as np

from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.types import MicroBatchLayout, PackedMicroBatch

CALLS_PER_HAND_OVER = 8
"""Python and C calls of the loop's thread per ``next()`` of a staged micro-batch: 8 now
(``next``, ``__next__``, two clocks, the thread check, the queue's get and the credit's put, the
stats' ``handed``); 12 at 1bbf68d (the stats and the ``MicroBatch`` built there, then added to
the totals: three more frames and two ``object.__new__``)."""
FRAMES_PER_HAND_OVER = 2
"""Of those, the Python frames: 2 now, 4 at 1bbf68d."""
BOUND_S = 60.0
LAYOUT = MicroBatchLayout.build({"tokens": ("int32", (256,)), "logprobs": ("float32", (256,))})


def _source(count: int, released: list[int]) -> Iterator[PackedMicroBatch]:
    """``count`` micro-batches in one reused buffer (a lease to copy: no private view)."""
    buffer = np.zeros(LAYOUT.nbytes, np.uint8)
    for index in range(count):
        LAYOUT.numpy_views(buffer)["tokens"][:] = index
        yield PackedMicroBatch(LAYOUT, buffer, lambda i=index: released.append(i))


def _staged(it: MicroBatchIterator) -> None:
    """Wait (bounded) until the prefetch thread queued the next micro-batch, so that ``next()``
    takes its path for a staged one whatever the machine's load."""
    deadline = time.monotonic() + BOUND_S
    while it._prefetcher.ready.empty():
        assert time.monotonic() < deadline, "the prefetch thread staged nothing"
        time.sleep(0.001)


def test_a_staged_hand_over_makes_few_calls_and_builds_nothing() -> None:
    """Per ``next()`` of a micro-batch already staged, the loop's thread (only it: the profile
    is this thread's) stays within the bounds above and calls no ``object.__new__``; every
    micro-batch arrives with its content, its index and its wait (on 1bbf68d: 12 calls, 4
    frames, 2 ``object.__new__``)."""
    count = 24
    released: list[int] = []
    counts = {"calls": 0, "frames": 0, "new": 0}
    counting = False

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if counting and event in ("call", "c_call"):
            counts["calls"] += 1
            counts["frames"] += event == "call"
            counts["new"] += event == "c_call" and arg is object.__new__

    per_hand_over = []
    waits: list[float] = []
    config = MicroBatchIterator.Config(depth=2, next_timeout_s=BOUND_S)
    with MicroBatchIterator(_source(count, released), config, device="cpu") as it:
        for index in range(count):
            _staged(it)
            before = dict(counts)
            sys.setprofile(profile)
            counting = True
            batch = next(it)
            counting = False
            sys.setprofile(None)
            per_hand_over.append({key: counts[key] - before[key] for key in counts})
            assert batch.index == index and batch.stats.index == index
            assert int(batch["tokens"][0]) == index and batch.stats.wait_s > 0
            waits.append(batch.stats.wait_s)
        assert it.stats.count == count
        assert math.isclose(it.stats.wait_s, sum(waits))  # the totals add the batches' waits
    steady = per_hand_over[1:]
    assert statistics.median(c["calls"] for c in steady) <= CALLS_PER_HAND_OVER, steady
    assert statistics.median(c["frames"] for c in steady) <= FRAMES_PER_HAND_OVER, steady
    assert max(c["new"] for c in steady) == 0, steady
    assert released == list(range(count))
