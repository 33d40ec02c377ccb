"""The shared types: unit keys round-trip, layouts align fields and give zero-copy views."""

import numpy as np
import pytest

from knitkit.types import (
    LAYOUT_ALIGNMENT,
    MicroBatchLayout,
    PackedMicroBatch,
    TrajectoryMeta,
    UnitKey,
)


def test_unit_key_round_trips_through_text() -> None:
    key = UnitKey("traj-7", "routing")
    assert UnitKey.parse(str(key)) == key
    with pytest.raises(ValueError, match="not a unit key"):
        UnitKey.parse("no-separator")


def test_layout_views_are_aligned_and_zero_copy() -> None:
    layout = MicroBatchLayout.build(
        {"tokens": ("int32", (5,)), "routing": ("uint8", (5, 3, 2)), "logprobs": ("float32", (5,))}
    )
    assert all(v.offset % LAYOUT_ALIGNMENT == 0 for v in layout.fields)
    buffer = bytearray(layout.nbytes)
    views = layout.numpy_views(buffer)
    views["logprobs"][:] = -1.5
    again = layout.numpy_views(buffer)
    np.testing.assert_array_equal(again["logprobs"], np.full(5, -1.5, np.float32))
    assert views["routing"].shape == (5, 3, 2)
    with pytest.raises(ValueError, match="layout needs"):
        layout.numpy_views(bytearray(8))


def test_trajectory_meta_rejects_inconsistent_versions() -> None:
    with pytest.raises(ValueError, match="min_version"):
        TrajectoryMeta("t", "s", "math", 0, 10, min_version=3, max_version=2)


def test_unit_layout_names_its_units_in_a_field_of_its_own() -> None:
    """A layout of whole units lists their keys in ``units`` (field order), not in
    ``trajectory_ids``; ``unit_views`` gives each unit's view by key, keys with '/' included."""
    keys = (UnitKey("sha-a", "image"), UnitKey("sha-b", "video/frames"))
    layout = MicroBatchLayout.of_units(
        {keys[0]: ("uint8", (2, 3)), keys[1]: ("float32", (4,))}, extra={"micro_batch": 1}
    )
    assert layout.units == keys and layout.trajectory_ids == ()
    assert layout.extra == {"micro_batch": 1}
    buffer = bytearray(layout.nbytes)
    views = layout.unit_views(buffer)
    assert list(views) == list(keys)
    views[keys[1]][:] = 2.5
    np.testing.assert_array_equal(layout.unit_views(buffer)[keys[1]], np.full(4, 2.5, np.float32))
    with pytest.raises(ValueError, match="of_units"):
        MicroBatchLayout.build({"tokens": ("int32", (5,))}).unit_views(bytearray(64))


def test_packed_micro_batch_releases_its_buffer_once() -> None:
    """``release()`` hands the buffer back exactly once however often it is called; ``fields``
    are views of the buffer."""
    layout = MicroBatchLayout.build({"x": ("int64", (3,))})
    buffer = bytearray(layout.nbytes)
    calls: list[int] = []
    batch = PackedMicroBatch(layout, buffer, on_release=lambda: calls.append(1), seq=7)
    batch.fields["x"][:] = 5
    assert layout.numpy_views(buffer)["x"].tolist() == [5, 5, 5]
    batch.release()
    batch.release()
    assert calls == [1] and batch.released and batch.seq == 7
