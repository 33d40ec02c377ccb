"""The one range check every backend shares (``check_ranges``), as a property (issue 9, class 10)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from knitkit.storage.backends.backend import UnitSpec
from knitkit.storage.backends.ranges import ReadCounter, check_ranges
from knitkit.types import UnitKey

KEY = UnitKey("t0", "tokens")


@given(
    length=st.integers(0, 12),
    ranges=st.lists(st.tuples(st.integers(-2, 14), st.integers(-2, 14)), max_size=4),
)
def test_ranges_are_accepted_exactly_when_in_bounds_ordered_and_disjoint(length, ranges) -> None:
    """Accepted iff every range has 0 <= start <= stop <= length and no two non-empty ranges
    overlap (an overlap would deliver rows twice); a rejection is an ``IndexError`` naming the
    unit; an accepted read returns exactly the concatenated rows and counts their bytes."""
    spans = sorted((a, b) for a, b in ranges if a < b)
    valid = all(0 <= a <= b <= length for a, b in ranges) and all(
        c >= b for (_, b), (c, _) in itertools.pairwise(spans)
    )
    spec = UnitSpec("int32", (length, 2))
    if not valid:
        with pytest.raises(IndexError, match="t0/tokens"):
            check_ranges(KEY, spec, ranges)
        return
    unit = np.arange(2 * length, dtype=np.int32).reshape(length, 2)
    counter = ReadCounter()
    got = counter.copy_rows(KEY, unit, ranges, None)
    want = np.concatenate([unit[a:b] for a, b in ranges]) if ranges else unit[:0]
    np.testing.assert_array_equal(got, want)
    assert counter.bytes == want.nbytes


@pytest.mark.parametrize("bad", [(0.0, 2), (0, 2.5), (True, 2), ("0", 2), (None, 1)])
def test_range_bounds_must_be_integers(bad) -> None:
    """Float, bool, string or missing bounds are a ``TypeError`` naming the unit and the value."""
    with pytest.raises(TypeError, match=r"t0/tokens"):
        check_ranges(KEY, UnitSpec("int32", (4,)), [bad])
