"""MicroBatch views and statistics."""

from __future__ import annotations

import pytest
import torch

from knitkit.microbatch_iter import IterStats, MicroBatch, MicroBatchStats, field_tensors
from knitkit.types import MicroBatchLayout


def test_field_tensors_are_views_of_the_flat_buffer():
    """Writing through a field view changes the flat buffer: views, not copies."""
    layout = MicroBatchLayout.build({"a": ("int64", (3,)), "b": ("uint16", (2, 2))})
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = field_tensors(flat, layout, {"b": torch.bfloat16})
    views["a"][1] = 7
    views["b"][0, 0] = 1.0
    assert views["b"].dtype == torch.bfloat16 and views["b"].shape == (2, 2)
    assert flat[8] == 7
    assert flat[layout.field("b").offset : layout.field("b").offset + 2].any()


def test_field_tensors_match_numpy_views_at_any_storage_offset():
    """Views built from precomputed offsets (one ``as_strided`` per field) read exactly what the
    layout's numpy views read, multi-dimensional fields included, over a flat tensor that starts
    inside a larger storage (a ring slot); a flat too short or an override of another width is
    refused, naming what is wrong."""
    layout = MicroBatchLayout.build(
        {
            "a": ("int64", (3,)),
            "r": ("uint8", (2, 3, 4)),
            "f": ("float32", (5,)),
            "e": ("int32", (0,)),
        }
    )
    storage = torch.arange(4096, dtype=torch.int64).view(torch.uint8)
    flat = storage[128 : 128 + layout.nbytes]
    views = field_tensors(flat, layout)
    expected = layout.numpy_views(flat.numpy())
    for name, array in expected.items():
        assert views[name].shape == array.shape and torch.equal(
            views[name], torch.from_numpy(array)
        )
    views["r"][1, 2, 3] = 255  # a view, not a copy
    assert expected["r"][1, 2, 3] == 255
    with pytest.raises(ValueError, match="at least"):
        field_tensors(flat[:64], layout)
    with pytest.raises(ValueError, match=r"'f'.*not as wide"):
        field_tensors(flat, layout, {"f": torch.bfloat16})


def test_iter_stats_totals_and_steady_wait():
    """Totals add up; the first wait is kept apart so steady-state waits can be read alone."""
    stats = IterStats()
    for i, wait in enumerate([0.5, 0.01, 0.02]):
        stats.add(MicroBatchStats(i, wait, fetch_s=0.1, stage_s=0.2, nbytes=100))
    assert stats.count == 3 and stats.nbytes == 300
    assert stats.first_wait_s == 0.5
    assert stats.steady_wait_s == pytest.approx(0.03)
    assert stats.stage_s == pytest.approx(0.6)


def test_missing_field_names_the_fields():
    """Indexing an unknown field lists the fields there are."""
    layout = MicroBatchLayout.build({"a": ("int8", (1,))})
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    mb = MicroBatch(0, layout, flat, field_tensors(flat, layout), MicroBatchStats(0, 0, 0, 0, 1))
    with pytest.raises(KeyError, match=r"'zz'.*\['a'\]"):
        mb["zz"]
