"""segment_ids: repeat_interleave's answer without torch's intra-op pool, on every hot path."""

from __future__ import annotations

import pytest
import torch

from encoder_dedup.harness import pool_idioms
from knitkit.encoder_dedup import (
    BackboneAssignment,
    EncoderAssignment,
    RowSlice,
    build_rank_route,
    segment_ids,
)
from knitkit.types import UnitKey


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_segment_ids_equal_repeat_interleave(dtype: torch.dtype) -> None:
    """On random lengths (empty segments included) ``segment_ids`` is repeat_interleave's
    answer, int64, without calling it; a wrong ``total`` is refused."""
    generator = torch.Generator().manual_seed(7)
    for trial in range(50):
        count = int(torch.randint(0, 12, (1,), generator=generator))
        lengths = torch.randint(0, 40, (count,), generator=generator, dtype=torch.int64)
        lengths[torch.rand(count, generator=generator) < 0.2] = 0
        expected = torch.repeat_interleave(torch.arange(count), lengths)
        lengths = lengths.to(dtype)
        with pool_idioms() as calls:
            ids = segment_ids(lengths, int(lengths.sum()) if trial % 2 else None)
        assert not calls, calls
        assert ids.dtype == torch.int64 and torch.equal(ids, expected), (trial, lengths)
    with pytest.raises(ValueError, match="sum to 5, not total=6"):
        segment_ids(torch.tensor([2, 3]), 6)


def test_route_row_indices_stay_off_the_intra_op_pool() -> None:
    """Every rank builds its dedup route each mini-batch: the route's row indices are the plan's
    (cache rows in order), built with neither idiom."""
    a, b = UnitKey("a", "image"), UnitKey("b", "image")
    encoder = EncoderAssignment({0: [[a]], 1: [[b]]}, {a: 6, b: 5})
    micro_batches = [[RowSlice(a, 1, 5), RowSlice(b, 0, 5)], [RowSlice(b, 2, 4)]]
    backbone = BackboneAssignment({0: micro_batches, 1: [[RowSlice(a, 0, 6)]]})
    with pool_idioms() as calls:
        route = build_rank_route(encoder, backbone, 2, 0)
    assert not calls, calls
    assert [ix.tolist() for ix in route.micro_batch_index] == [list(range(9)), [6, 7]]
    assert route.forward.recv_index.tolist() == list(range(9))
