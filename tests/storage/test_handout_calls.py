"""A rank's hand-out stays a bounded number of Python-level operations: right after compute every
operation runs with cold caches, so their number is what a hand-out costs (issue 31; NOTE [ Lease
in few calls ] in knitkit/storage/delivery/consumer.py, NOTE [ Hand-out objects without
__init__ ] in knitkit/microbatch_iter/batch.py); a repeated shape costs no per-field work (NOTE
[ Shapes decoded once ] in knitkit/storage/delivery/layout_codec.py)."""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable
from types import FrameType

import numpy as np
import pytest
from ring_parts import BOUND_S, published_ring

from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.microbatch_iter import batch as batches
from knitkit.storage.delivery.layout_codec import LayoutDecodeError, decode_layout, encode_layout
from knitkit.storage.delivery.slot_ring import RingSpec
from knitkit.types import MicroBatchLayout

CALLS_PER_HAND_OUT = 138
"""Python and C calls a rank's threads make per hand-out of a new shape (the loop's ``next()``
with its inline hand-out: decode, lease, views and release; NOTE [ Inline hand-out ] in
knitkit/microbatch_iter/worker.py): 130-131 now, 144-146 at b870bfe (a prefetch thread's
credit, queue and wake on top), 161-164 at 1cebb89 (~61 Python frames), ~200 at 62f8166."""
CALLS_PER_REPEATED_SHAPE = 125
"""The same, where each slot's micro-batches repeat one shape: 101-112 now (the fewest of three
runs still varies with how often the loop waits for the producer thread), 105-111 at b870bfe,
153-166 at 1cebb89 (a new ``FieldView`` per field decoded, then compared with the cached views'
field by field). The inline hand-out's cut is tested by its sleeps and threads
(tests/microbatch_iter/test_leases.py), not here."""
_RUNS = itertools.count()
"""Distinct token counts per run: the decoder keeps the shapes it saw (NOTE [ Shapes decoded
once ]), so a run that must see new shapes does not reuse an earlier run's."""


def _layout(i: int, run: int = 0) -> MicroBatchLayout:
    """transfer.py's 9 fields, a new token count (so a new layout) per micro-batch and run."""
    t = 64 + 100 * run + (i * 37) % 61
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


def _calls_in_rank_threads(count: int, shapes: int = 0) -> int:
    """Calls (Python and C) made by the loop's thread and the iterator's prefetch thread (if
    any) while ``count`` micro-batches are handed out, each checked for its bytes; the producer thread,
    started before the profiler, is not counted. Each micro-batch has a new shape, or with
    ``shapes`` one of that many, cycling (the ring's slot count: each slot repeats one)."""
    run = next(_RUNS)
    layouts = [_layout(i % shapes if shapes else i, run) for i in range(count)]
    for i, layout in enumerate(layouts):
        layout.extra["micro_batch"] = i
    largest = max(layout.nbytes for layout in layouts)
    spec = RingSpec.new(num_slots=shapes or 3, slot_bytes=largest, num_consumers=1)
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
            for i, layout in enumerate(layouts):
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


def _calls_per_hand_out(shapes: int = 0) -> float:
    """Calls per hand-out in the steady state: runs of two lengths, the difference divided by the
    difference in micro-batches (start-up and close cancel out)."""
    _calls_in_rank_threads(4, shapes)  # imports and first-use caches out of the way
    # a thread that waits (for a publication, a credit, a record) makes more calls: the fewest
    # of three runs is the hand-out's own path
    short = min(_calls_in_rank_threads(15, shapes) for _ in range(3))
    long = min(_calls_in_rank_threads(33, shapes) for _ in range(3))
    return (long - short) / 18


def test_a_hand_out_makes_a_bounded_number_of_calls() -> None:
    """Over a real ring of 3 slots fed by a producer thread, with a new layout per micro-batch,
    the calls per hand-out stay under the bound (on b870bfe: 144-146, above it)."""
    per_hand_out = _calls_per_hand_out()
    assert per_hand_out <= CALLS_PER_HAND_OUT, per_hand_out


def test_a_repeated_shape_makes_no_per_field_calls() -> None:
    """Where each slot's micro-batches repeat one shape, a hand-out makes far fewer calls than
    one of a new shape: the decoder hands out the tuple of views it decoded before and the view
    cache recognises it by identity, so no view object, comparison or torch call is made per
    field (on 1cebb89: 153-166, above the bound)."""
    per_hand_out = _calls_per_hand_out(shapes=3)
    assert per_hand_out <= CALLS_PER_REPEATED_SHAPE, per_hand_out


def test_a_repeated_shape_decodes_to_the_same_views_and_is_checked_against_its_size() -> None:
    """The decoder returns the very tuple of ``FieldView``s it decoded before for a record of
    the same fields, offsets and first dimensions (other trajectories and extras may differ),
    and still refuses such a record whose ``nbytes`` no longer covers its last field (on
    1cebb89: a new tuple per decode)."""
    capacity = 1 << 20
    first = _layout(5, run=next(_RUNS))
    again = MicroBatchLayout(
        first.fields, first.nbytes, first.cu_seqlens_padded, ("other",), (), {"micro_batch": 9}
    )
    decoded = [decode_layout(encode_layout(layout), capacity) for layout in (first, first, again)]
    assert decoded[0] == first and decoded[2] == again
    assert decoded[1].fields is decoded[2].fields
    last = first.fields[-1]
    short = MicroBatchLayout(first.fields, last.offset + last.nbytes - 4, first.cu_seqlens_padded)
    with pytest.raises(LayoutDecodeError, match=r"cu_seqlens.*past"):
        decode_layout(encode_layout(short), capacity)


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
