"""A rank's hand-out stays a bounded number of Python-level operations: right after compute every
operation runs with cold caches, so their number is what a hand-out costs (issue 31; NOTE [ Lease
in few calls ] in knitkit/storage/delivery/consumer.py, NOTE [ Hand-out objects without
__init__ ] in knitkit/microbatch_iter/batch.py)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType

import numpy as np
import pytest
from ring_parts import BOUND_S, published_ring

from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.microbatch_iter import batch as batches
from knitkit.storage.delivery.slot_ring import RingSpec
from knitkit.types import MicroBatchLayout

CALLS_PER_HAND_OUT = 180
"""Python and C calls a rank's threads make per hand-out (the loop's ``next()``, the prefetch
thread's wait, decode, lease, views and release): ~160 now, ~200 at 62f8166."""


def _layout(i: int) -> MicroBatchLayout:
    """transfer.py's 9 fields, a new token count (so a new layout) per micro-batch."""
    t = 64 + (i * 37) % 61
    return MicroBatchLayout.build(
        {
            "tokens": ("int32", (t,)),
            "positions": ("int32", (t,)),
            "logprobs": ("float32", (t,)),
            "ref_logprobs": ("float32", (t,)),
            "advantages": ("float32", (t,)),
            "loss_mask": ("uint8", (t,)),
            "routing": ("uint8", (t, 24, 12)),
            "topp": ("uint8", (t, 16)),
            "cu_seqlens": ("int32", (9,)),
        },
        cu_seqlens_padded=(0, t),
        trajectory_ids=(f"traj-{i}",),
        extra={"micro_batch": i},
    )


def _calls_in_rank_threads(count: int) -> int:
    """Calls (Python and C) made by the loop's thread and the iterator's prefetch thread while
    ``count`` micro-batches are handed out, each checked for its bytes; the producer thread,
    started before the profiler, is not counted."""
    largest = max(_layout(i).nbytes for i in range(count))
    spec = RingSpec.new(num_slots=12, slot_bytes=largest, num_consumers=1)
    calls = 0
    loop = threading.get_ident()
    reading = False
    """True while the loop reads a micro-batch: its own calls, not the hand-out's."""

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if (event == "call" or event == "c_call") and not (
            reading and threading.get_ident() == loop
        ):
            calls += 1

    with published_ring(spec) as ring:

        def produce() -> None:
            for i in range(count):
                layout = _layout(i)
                buffer = ring.publisher.acquire(layout.nbytes)
                np.frombuffer(buffer, np.uint8)[: layout.nbytes] = i % 251
                ring.publisher.publish(layout)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        seen = []
        config = MicroBatchIterator.Config(depth=2, next_timeout_s=BOUND_S)
        threading.setprofile(profile)  # threads started from now on: the prefetch thread
        sys.setprofile(profile)
        try:
            with MicroBatchIterator(ring.consumers[0].take(count), config, device="cpu") as it:
                for batch in it:
                    reading = True
                    seen.append((int(batch["routing"][-1, -1, -1]), batch.layout.extra))
                    reading = False
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
        producer.join(BOUND_S)
        assert not producer.is_alive()
    assert seen == [(i % 251, {"micro_batch": i}) for i in range(count)]
    return calls


def test_a_hand_out_makes_a_bounded_number_of_calls() -> None:
    """Over a real ring fed by a producer thread, with a new layout per micro-batch, the calls
    per hand-out in the steady state (runs of two lengths, the difference divided by the
    difference in micro-batches: start-up and close cancel out) stay under the bound (on
    62f8166: ~200, above it)."""
    _calls_in_rank_threads(4)  # imports and first-use caches out of the way
    # a thread that waits (for a publication, a credit, a record) makes more calls: the fewest
    # of three runs is the hand-out's own path
    short = min(_calls_in_rank_threads(14) for _ in range(3))
    long = min(_calls_in_rank_threads(30) for _ in range(3))
    per_hand_out = (long - short) / 16
    assert per_hand_out <= CALLS_PER_HAND_OUT, per_hand_out


@pytest.mark.parametrize("name", ["build_stats", "build_micro_batch"])
def test_hand_out_objects_equal_their_constructors(name: str) -> None:
    """``build_stats`` and ``build_micro_batch`` make the same frozen objects as the classes'
    constructors (equal, still frozen)."""
    build: Callable[..., object] = getattr(batches, name)
    stats = batches.MicroBatchStats(3, 0.5, 0.25, 0.125, 64)
    if name == "build_stats":
        made, expected = build(3, 0.5, 0.25, 0.125, 64), stats
    else:
        args = (3, _layout(0), None, {}, stats)
        made, expected = build(*args), batches.MicroBatch(*args)  # type: ignore[arg-type]
    assert made == expected and type(made) is type(expected)
    with pytest.raises(AttributeError):
        made.index = 4  # type: ignore[attr-defined]
