"""The CP split helpers: every rank's chunks at once equal each rank's own."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knitkit.storage.planning.cp import chunks_by_rank, cp_chunks, rank_chunks


@settings(max_examples=100, deadline=None)
@given(cp=st.integers(1, 5), units=st.lists(st.integers(0, 400), max_size=30))
def test_chunks_by_rank_equals_rank_chunks_of_each_rank(cp: int, units: list[int]) -> None:
    """``chunks_by_rank(padded, cp)[r] == rank_chunks(padded, cp, r)`` for every rank, and each
    sequence's chunks over all ranks tile ``[0, padded)`` exactly once."""
    padded = np.array(units, dtype=np.int64) * 2 * cp
    every = chunks_by_rank(padded, cp)
    assert every == [rank_chunks(padded, cp, r) for r in range(cp)]
    for i, length in enumerate(padded.tolist()):
        ranges = sorted(r for rank in every for r in rank[i] if r[1] > r[0])
        assert sum(b - a for a, b in ranges) == length
        assert all(a == b for (_, a), (b, _) in itertools.pairwise(ranges))
        assert [cp_chunks(length, cp, r) for r in range(cp)] == [rank[i] for rank in every]


def test_unpadded_lengths_are_refused_naming_them() -> None:
    """A length that is not a multiple of 2*cp raises ``ValueError`` naming it."""
    with pytest.raises(ValueError, match=r"\[6\].*2\*cp=4"):
        chunks_by_rank(np.array([8, 6, 12]), 2)
