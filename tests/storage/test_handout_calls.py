"""A rank's hand-out stays a bounded number of Python-level operations: right after compute every
operation runs with cold caches, so their number is what a hand-out costs (issue 31; NOTE [ Lease
in few calls ] in knitkit/storage/delivery/consumer.py, NOTE [ Hand-out objects without
__init__ ] in knitkit/microbatch_iter/batch.py); a repeated shape costs no per-field work (NOTE
[ Shapes decoded once ] in knitkit/storage/delivery/layout_codec.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import statistics
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType, SimpleNamespace

import numpy as np
import pytest
from ring_parts import BOUND_S, published_ring
from torch.overrides import TorchFunctionMode

from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.microbatch_iter import batch as batches
from knitkit.storage.delivery.layout_codec import LayoutDecodeError, decode_layout, encode_layout
from knitkit.storage.delivery.slot_ring import RingSpec
from knitkit.storage.delivery.written_pages import WrittenPages
from knitkit.types import MicroBatchLayout, PackedMicroBatch

CALLS_PER_HAND_OUT = 110
"""Python and C calls a rank's thread makes per hand-out of a new shape (the loop's ``next()``
with its inline hand-out: release, decode, lease, views and stats; NOTE [ Inline hand-out ] in
knitkit/microbatch_iter/worker.py), published before the loop asks for it: 108 now, 113 at
d1b4542 (a once-only wrapper's frame per release, the private view and the lease in two
frames, the stats and the ``MicroBatch`` in two), 118 at 8014ff5. With a producer thread racing
the loop (this test before): 130-131 at 8014ff5, 144-146 at b870bfe, 161-164 at 1cebb89, ~200
at 62f8166."""
FRAMES_PER_HAND_OUT = 30
"""Of those, the Python frames: 29 now, 33 at d1b4542, 38 at 8014ff5."""
CALLS_PER_REPEATED_SHAPE = 68
"""The same where each slot's micro-batches repeat one shape: 66 now, 76 at d1b4542 (on top of
the above: the field table unpacked and its columns hashed to find the shape, ``check_layout``
and the slot's tensors each a frame although the slot's views were cached), 81 at 8014ff5
(153-166 at 1cebb89 with a producer thread)."""
FRAMES_PER_REPEATED_SHAPE = 27
"""Of those, the Python frames: 26 now, 31 at d1b4542."""
_PAGE_MAP_READ = WrittenPages.span.__code__
"""A release reads the page map only if the process took a page fault since the slot was last
clean (NOTE [ Written pages only after a fault ] in slot_ring.py; bounded by
tests/microbatch_iter/test_rank_faults.py): how often depends on what else the process did (the
tests run before this one), so its calls are left out of these counts."""
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


def _calls_per_hand_out(shapes: int = 0, count: int = 30) -> tuple[float, float]:
    """Calls (Python and C) and Python frames per ``next()``, medians over ``count`` hand-outs
    after each slot's first, made by the loop's thread inside ``next()`` and by any thread
    started meanwhile. Each micro-batch is published (on this thread, not counted) before the
    loop asks for it, so no hand-out waits and no release wakes the producer: the counts are the
    hand-out's own path, whatever the machine's load. Each micro-batch has a new shape, or with
    ``shapes`` one of that many, cycling (the ring's slot count: each slot repeats one)."""
    counts = [0, 0]  # calls, frames
    counting = False
    loop = threading.get_ident()

    reading: list[FrameType] = []
    """The page-map read under way, if any: not counted (``_PAGE_MAP_READ``)."""

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if reading:
            if event == "return" and frame is reading[0]:
                reading.clear()
        elif event == "call" and frame.f_code is _PAGE_MAP_READ:
            reading.append(frame)
        elif (event == "call" or event == "c_call") and (counting or threading.get_ident() != loop):
            counts[0] += 1
            counts[1] += event == "call"

    @contextlib.contextmanager
    def profiled() -> Iterator[None]:
        threading.setprofile(profile)  # threads started from now on
        sys.setprofile(profile)
        try:
            yield
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]

    def hand_out(iterator: Iterator[batches.MicroBatch]) -> batches.MicroBatch:
        nonlocal counting
        before = list(counts)
        counting = True
        batch = next(iterator)
        counting = False
        per_hand_out.append((counts[0] - before[0], counts[1] - before[1]))
        return batch

    per_hand_out: list[tuple[int, int]] = []
    steady = _hand_out_each(shapes, count, hand_out, profiled)
    return (
        statistics.median(calls for calls, _ in per_hand_out[steady:]),
        statistics.median(frames for _, frames in per_hand_out[steady:]),
    )


def _hand_out_each(
    shapes: int,
    count: int,
    hand_out: Callable[[Iterator[batches.MicroBatch]], batches.MicroBatch],
    around: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
) -> int:
    """Publish ``count`` micro-batches (each a new shape, or one of ``shapes``) over a real ring
    of a slot per shape (3 for new shapes), each just before ``hand_out`` takes it from a CPU
    iterator, under ``around()`` (entered once the ring and its publisher run); check each
    arrived; return how many hand-outs set a slot up first (the others are steady)."""
    run = next(_RUNS)
    layouts = [_layout(i % shapes if shapes else i, run) for i in range(count)]
    for i, layout in enumerate(layouts):
        layout.extra["micro_batch"] = i
    num_slots = shapes or 3
    spec = RingSpec.new(
        num_slots=num_slots, slot_bytes=max(layout.nbytes for layout in layouts), num_consumers=1
    )
    seen = []
    with published_ring(spec) as ring, around():
        config = MicroBatchIterator.Config(depth=2, next_timeout_s=BOUND_S)
        with MicroBatchIterator(ring.consumers[0].take(count), config, device="cpu") as it:
            for i, layout in enumerate(layouts):
                buffer = ring.publisher.acquire(layout.nbytes)
                np.frombuffer(buffer, np.uint8)[: layout.nbytes] = i % 251
                ring.publisher.publish(layout)
                batch = hand_out(it)
                seen.append((int(batch["routing"][-1, -1, -1]), batch.layout.extra))
    assert seen == [(i % 251, {"micro_batch": i}) for i in range(count)]
    return num_slots + 1  # each slot's first hand-out sets it up


def test_a_hand_out_makes_a_bounded_number_of_calls() -> None:
    """Over a real ring of 3 slots, with a new layout per micro-batch, the calls and Python
    frames per hand-out stay under their bounds (on d1b4542: 113 calls and 33 frames, above
    them)."""
    calls, frames = _calls_per_hand_out()
    assert calls <= CALLS_PER_HAND_OUT, calls
    assert frames <= FRAMES_PER_HAND_OUT, frames


def test_a_repeated_shape_makes_no_per_field_calls() -> None:
    """Where each slot's micro-batches repeat one shape, a hand-out makes far fewer calls than
    one of a new shape: the decoder hands out the tuple of views it decoded before and the view
    cache recognises it by identity, so no view object, comparison or torch call is made per
    field (on d1b4542: 76 calls and 31 frames, above the bounds)."""
    calls, frames = _calls_per_hand_out(shapes=3)
    assert calls <= CALLS_PER_REPEATED_SHAPE, calls
    assert frames <= FRAMES_PER_REPEATED_SHAPE, frames


class _TorchCalls(TorchFunctionMode):
    """The torch functions called while it is entered, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_a_new_shape_calls_two_torch_entry_points() -> None:
    """A hand-out of a new shape builds its flat tensor and every field view with
    ``as_strided`` and checks ``requires_grad``: no other torch entry point, each of which costs
    its dispatch code fetched again right after compute (NOTE [ One torch entry point per
    view ] in knitkit/microbatch_iter/batch.py; on ee9a537 also a slice, ``numel`` and
    ``data_ptr``)."""
    per_hand_out: list[list[str]] = []

    def hand_out(iterator: Iterator[batches.MicroBatch]) -> batches.MicroBatch:
        with _TorchCalls() as calls:
            batch = next(iterator)
        per_hand_out.append(calls.names)
        return batch

    steady = _hand_out_each(0, 12, hand_out)
    for names in per_hand_out[steady:]:
        assert set(names) == {"as_strided", "__get__"}, names
        assert names.count("as_strided") == 1 + len(_layout(0).fields), names


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


@pytest.mark.parametrize("name", ["IterStats.record", "build_micro_batch"])
def test_hand_out_objects_equal_their_constructors(name: str) -> None:
    """``IterStats.record`` and ``build_micro_batch`` make the same frozen objects as the
    classes' constructors (equal, still frozen); ``record`` adds them to the totals."""
    made: object
    layout = _layout(0)
    stats = batches.MicroBatchStats(3, 0.5, 0.25, 0.125, layout.nbytes)
    staged = SimpleNamespace(
        index=3, layout=layout, flat=None, tensors={}, fetch_s=0.25, stage_s=0.125
    )
    if name == "IterStats.record":
        totals = batches.IterStats()
        made, expected = totals.record(staged, 0.5), stats  # type: ignore[arg-type]
        assert totals == batches.IterStats(1, 0.5, 0.5, 0.25, 0.125, layout.nbytes)
    else:
        made = batches.build_micro_batch(staged, 0.5)  # type: ignore[arg-type]
        expected = batches.MicroBatch(3, layout, None, {}, stats)  # type: ignore[arg-type]
        assert made.stats == stats and type(made.stats) is batches.MicroBatchStats  # type: ignore[attr-defined]
    assert made == expected and type(made) is type(expected)
    with pytest.raises(AttributeError):
        made.index = 4  # type: ignore[attr-defined]


def test_a_lease_built_without_its_init_has_every_field() -> None:
    """A consumer builds its leases without ``PackedMicroBatch.__init__`` (NOTE [ Lease in few
    calls ]): every field is set as the constructor would set it, and the lease releases once."""
    layout = _layout(0, run=next(_RUNS))
    spec = RingSpec.new(num_slots=2, slot_bytes=layout.nbytes, num_consumers=1)
    with published_ring(spec) as ring:
        buffer = ring.publisher.acquire(layout.nbytes)
        np.frombuffer(buffer, np.uint8)[: layout.nbytes] = 7
        ring.publisher.publish(layout)
        lease = ring.consumers[0].next_micro_batch(BOUND_S)
        expected = PackedMicroBatch(layout, lease.buffer, lease.on_release, 0, lease.private)
        assert [getattr(lease, f.name) for f in dataclasses.fields(PackedMicroBatch)] == [
            getattr(expected, f.name) for f in dataclasses.fields(PackedMicroBatch)
        ]
        assert lease.layout == layout and not lease.buffer.flags.writeable
        assert bytes(lease.buffer[:3]) == b"\x07\x07\x07" and lease.private() is lease.private()
        lease.release()
        lease.release()
        assert lease.on_release is not None
        lease.on_release()  # its release by itself: a second one returns at once
        assert lease.released and ring.owner.released(0) == 1
