"""Slot-ring metadata: layouts travel as data, and hostile or corrupt records never escape the slot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from types import FrameType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitkit.storage.delivery.atomic_words import futex_available
from knitkit.storage.delivery.layout_codec import DTYPES, decode_layout, encode_layout
from knitkit.storage.delivery.slot_ring import _META_HEADER, RingSpec, SlotRing
from knitkit.types import FieldView, MicroBatchLayout, UnitKey

SLOT = 1 << 16

text = st.text(st.characters(exclude_characters="\0", exclude_categories=("Cs",)), max_size=12)
names = text.filter(bool)
shapes = st.lists(st.integers(0, 40), max_size=4).map(tuple)
extras = st.dictionaries(
    names,
    st.one_of(st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), text),
    max_size=4,
)


@st.composite
def layouts(draw: st.DrawFn) -> MicroBatchLayout:
    specs = draw(st.dictionaries(names, st.tuples(st.sampled_from([n for n, _ in DTYPES]), shapes)))
    if draw(st.booleans()):
        keys = draw(st.lists(st.tuples(names.filter(lambda s: "/" not in s), names), max_size=3))
        units = {UnitKey(o, f): spec for (o, f), spec in zip(keys, specs.values(), strict=False)}
        return MicroBatchLayout.of_units(units, extra=draw(extras))
    return MicroBatchLayout.build(
        specs,
        cu_seqlens_padded=tuple(draw(st.lists(st.integers(0, 2**40), max_size=9))),
        trajectory_ids=tuple(draw(st.lists(names, max_size=5))),
        extra=draw(extras),
    )


@pytest.fixture(scope="module")
def ring():
    """A 2-slot ring of 64 KiB slots (module-wide: metadata tests only write and read metadata)."""
    spec = RingSpec.new(num_slots=2, slot_bytes=SLOT, num_consumers=1)
    owner = SlotRing.create(spec)
    yield owner
    owner.close()
    owner.unlink()
    assert not os.path.exists(f"/dev/shm/{spec.name}")


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_layout_round_trips(layout: MicroBatchLayout) -> None:
    """Every layout of plain numeric fields decodes to an equal layout (fields, sizes, sequence
    ids, units and extras of every kind, unicode names included)."""
    assert decode_layout(encode_layout(layout), capacity=1 << 62) == layout


def test_ring_round_trip_and_stale_slot(ring: SlotRing) -> None:
    """What ``write_meta`` stored for seq is what ``read_meta`` returns; asking for another seq
    of the same slot names both."""
    layout = MicroBatchLayout.build(
        {"tokens": ("int64", (100,)), "routing": ("uint8", (100, 4, 8))},
        cu_seqlens_padded=(0, 60, 100),
        trajectory_ids=("t0", "t1"),
        extra={"minibatch_id": "mb0", "micro_batch": 3, "loss_scale": 0.5},
    )
    ring.write_meta(5, layout)
    assert ring.read_meta(5) == layout
    with pytest.raises(RuntimeError, match="slot holds 5, not 7"):
        ring.read_meta(7)


def test_field_past_the_slot_is_refused(ring: SlotRing) -> None:
    """A record whose field lies (partly) outside the ring's slot is refused when read, naming the
    field: a consumer never gets a view of bytes beyond its slot."""
    inside = FieldView("tokens", "int64", (8,), 0)
    for bad, nbytes in (
        (FieldView("routing", "uint8", (SLOT,), 64), SLOT + 64),
        (FieldView("routing", "float32", (4,), 2**62), 2**62 + 16),
    ):
        ring.write_meta(0, MicroBatchLayout((inside, bad), nbytes))
        with pytest.raises(RuntimeError, match="malformed metadata of micro-batch 0"):
            ring.read_meta(0)
    beyond = MicroBatchLayout((inside, FieldView("routing", "uint8", (128,), 64)), 128)
    ring.write_meta(0, beyond)
    with pytest.raises(RuntimeError, match=r"field 'routing'.*reaches past"):
        ring.read_meta(0)


def test_unsupported_dtype_is_refused_at_publication(ring: SlotRing) -> None:
    """A field whose dtype has no code (objects, strings, structured) cannot be published; the
    error names the field and the dtypes that can. Nor can a string holding NUL (the strings'
    terminator)."""
    layout = MicroBatchLayout((FieldView("ids", "object", (4,), 0),), 32)
    with pytest.raises(ValueError, match=r"field 'ids'.*uint16"):
        ring.write_meta(1, layout)
    named = MicroBatchLayout.build({"x": ("int64", (1,))}, trajectory_ids=("t\x00rogue",))
    with pytest.raises(ValueError, match=r"rogue.*NUL"):
        ring.write_meta(1, named)


def _record(ring: SlotRing, seq: int) -> tuple[int, int]:
    """Offset and length of the layout record stored for ``seq``."""
    start = ring.spec._meta_offset + (seq % ring.spec.num_slots) * ring.spec.meta_bytes
    return start + _META_HEADER.size, _META_HEADER.unpack_from(ring._buf, start)[1]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupt_records_never_escape_the_slot(ring: SlotRing, data: st.DataObject) -> None:
    """Whatever bytes a producer leaves in a slot's record (any overwritten span, a truncated
    or lengthened record), ``read_meta`` either raises ``RuntimeError`` or returns a layout whose
    every field has a plain numeric dtype and lies inside the slot."""
    layout = MicroBatchLayout.build(
        {"tokens": ("int64", (300,)), "routing": ("uint8", (300, 6, 8)), "mask": ("bool", (300,))},
        cu_seqlens_padded=(0, 100, 300),
        trajectory_ids=("a", "b"),
        extra={"minibatch_id": "mb", "micro_batch": 1},
    )
    ring.write_meta(1, layout)
    offset, length = _record(ring, 1)
    at = data.draw(st.integers(0, length - 1))
    junk = data.draw(st.binary(min_size=1, max_size=16))
    ring._buf[offset + at : offset + at + len(junk)] = junk
    new_length = data.draw(st.sampled_from([length, length - 1, length + 8, 3]))
    _META_HEADER.pack_into(ring._buf, offset - _META_HEADER.size, 1, new_length)
    try:
        decoded = ring.read_meta(1)
    except RuntimeError as exc:
        assert "micro-batch 1" in str(exc)
        return
    assert decoded.nbytes <= SLOT
    for view in decoded.fields:
        assert np.dtype(view.dtype).kind in "biuf"
        assert view.offset >= 0 and view.offset + view.nbytes <= decoded.nbytes


@pytest.mark.parametrize(
    ("fields", "nbytes", "named"),
    [
        ((FieldView("empty", "int64", (2**64 - 1, 0), 0),), 64, r"field 'empty'.*cannot be viewed"),
        ((FieldView("odd", "int64", (2,), 3),), 64, r"field 'odd'.*offset 3.*cannot be viewed"),
        (
            (FieldView("a", "int64", (8,), 0), FieldView("b", "int32", (4,), 0)),
            64,
            r"fields '[ab]' and '[ab]' overlap",
        ),
        (
            (FieldView("x", "int64", (1,), 0), FieldView("x", "int64", (1,), 64)),
            128,
            r"field 'x' appears twice",
        ),
    ],
    ids=["huge-zero-size", "misaligned", "overlapping", "duplicate-name"],
)
def test_fields_that_cannot_be_viewed_are_refused_naming_ring_and_field(
    ring: SlotRing, fields: tuple[FieldView, ...], nbytes: int, named: str
) -> None:
    """A record whose field fits the slot but cannot be viewed (a dimension beyond the slot on a
    zero-size field, an offset off the layout alignment), or whose fields overlap or share a
    name, is refused at decode with an error naming the ring and the field."""
    ring.write_meta(0, MicroBatchLayout(fields, nbytes))
    with pytest.raises(RuntimeError, match=ring.spec.name) as info:
        ring.read_meta(0)
    assert re.search(named, str(info.value)), str(info.value)


def test_empty_fields_may_share_an_offset(ring: SlotRing) -> None:
    """Zero-size fields laid out by ``MicroBatchLayout.build`` (an idle rank's empty layout) sit
    at the next field's offset: not an overlap."""
    layout = MicroBatchLayout.build(
        {"none": ("int64", (0, 3)), "tokens": ("int32", (5,)), "more": ("float32", (0,))}
    )
    ring.write_meta(1, layout)
    assert ring.read_meta(1) == layout


_FORK_AND_EXIT = """
import os, sys
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
ring = SlotRing.create(RingSpec.new(num_slots=1, slot_bytes=4096, num_consumers=1))
if os.fork() == 0:
    sys.exit(0)  # a forked copy (a DataLoader worker) ends with a normal interpreter exit
_, status = os.wait()
ring.close()
ring.unlink()
sys.exit(status >> 8)
"""


def test_a_forked_copy_of_a_ring_owner_exits_quietly() -> None:
    """A forked child of a process that owns a ring exits without a traceback (the ring's
    mapping has live array views; ``SharedMemory.__del__`` used to print a BufferError there)
    and leaves the ring to its owner (issue 30, item 15)."""
    done = subprocess.run(
        [sys.executable, "-c", _FORK_AND_EXIT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]


@pytest.mark.skipif(not futex_available(), reason="futex waits are Linux-only")
def test_a_futex_wait_and_wake_run_no_python_frame_of_their_own() -> None:
    """A futex wait or wake is one C call below ``AtomicWords``: the syscall is bound to its
    number with ``functools.partial``, not a lambda, so a producer's slot wait and a consumer's
    wake of it run one Python frame fewer each, right after a sleep when frames cost most (NOTE
    [ Slot path in few calls ] in publication.py; a lambda's frame at d1b4542)."""
    spec = RingSpec.new(num_slots=1, slot_bytes=64, num_consumers=1)
    ring = SlotRing.create(spec)
    frames: list[str] = []

    def count(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            frames.append(frame.f_code.co_name)

    try:
        sys.setprofile(count)
        try:
            ring.wake_consumers()
            ring._atomic.wait(0, int(ring.words[0]) + 1, 1.0)  # the word differs: returns at once
        finally:
            sys.setprofile(None)
    finally:
        ring.close()
        ring.unlink()
    assert frames == ["wake_consumers", "wake", "wait"], frames
