"""The shared types: unit keys round-trip, layouts align fields and give zero-copy views."""

import numpy as np
import pytest

from knitkit.types import LAYOUT_ALIGNMENT, MicroBatchLayout, TrajectoryMeta, UnitKey


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
