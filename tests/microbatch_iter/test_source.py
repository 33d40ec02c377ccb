"""plan_staging: every accepted source item becomes one layout plus the copies that fill it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from knitkit.microbatch_iter import PackedMicroBatch, field_tensors, plan_staging
from knitkit.types import MicroBatchLayout


def packed(fields: dict[str, np.ndarray]) -> tuple[MicroBatchLayout, bytearray]:
    layout = MicroBatchLayout.build({n: (a.dtype.name, a.shape) for n, a in fields.items()})
    buffer = bytearray(layout.nbytes + 100)  # a slot larger than the micro-batch
    for name, view in layout.numpy_views(buffer).items():
        view[...] = fields[name]
    return layout, buffer


FIELDS = {
    "tokens": np.arange(10, dtype=np.int32),
    "routing": np.arange(60, dtype=np.uint8).reshape(10, 2, 3),
}


def roundtrip(item) -> dict[str, np.ndarray]:
    plan = plan_staging(item)
    dst = np.zeros(plan.layout.nbytes, dtype=np.uint8)
    plan.copy_into(dst)
    flat = torch.from_numpy(dst)
    return {n: t.numpy() for n, t in field_tensors(flat, plan.layout, plan.torch_dtypes).items()}


@pytest.mark.parametrize("form", ["packed", "tuple", "dict", "dict-of-tensors"])
def test_every_item_form_stages_to_the_same_fields(form):
    """Packed items, (layout, buffer) tuples and field dicts all rebuild the original fields."""
    layout, buffer = packed(FIELDS)
    item = {
        "packed": PackedMicroBatch(layout, memoryview(buffer)),
        "tuple": (layout, buffer),
        "dict": FIELDS,
        "dict-of-tensors": {n: torch.from_numpy(a) for n, a in FIELDS.items()},
    }[form]
    out = roundtrip(item)
    for name, array in FIELDS.items():
        np.testing.assert_array_equal(out[name], array)


def test_packed_item_is_one_copy_and_carries_its_release():
    """A packed item stages as a single flat copy of layout.nbytes, and exposes release()."""
    layout, buffer = packed(FIELDS)
    calls = []
    plan = plan_staging(PackedMicroBatch(layout, buffer, on_release=lambda: calls.append(1)))
    assert len(plan.copies) == 1 and plan.copies[0][1].nbytes == layout.nbytes
    assert plan.release is not None
    plan.release()
    assert calls == [1]


def test_non_contiguous_fields_are_copied_strided():
    """A transposed numpy field is staged with its logical values, not its memory order."""
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = roundtrip({"t": base.T})
    np.testing.assert_array_equal(out["t"], base.T)


def test_short_buffer_names_sizes():
    """A buffer shorter than its layout is refused with both sizes in the message."""
    layout, buffer = packed(FIELDS)
    with pytest.raises(ValueError, match=f"needs {layout.nbytes}"):
        plan_staging((layout, buffer[:8]))


def test_device_tensor_and_unknown_items_are_refused():
    """Non-CPU tensors and unknown item types raise errors that say what to pass instead."""
    with pytest.raises(ValueError, match="field 'x' is on meta"):
        plan_staging({"x": torch.empty(3, device="meta")})
    with pytest.raises(TypeError, match="PackedMicroBatch"):
        plan_staging(42)  # type: ignore[arg-type]
