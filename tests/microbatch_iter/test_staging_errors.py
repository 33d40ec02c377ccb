"""Staging never corrupts silently: byte order, empty micro-batches, unsupported dtypes, consumers."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from knitkit.microbatch_iter import MicroBatchIterator, PackedMicroBatch
from knitkit.types import MicroBatchLayout


@pytest.mark.parametrize("dtype", [">i4", ">f8", ">u2", "<i8", ">c8"])
def test_non_native_byte_order_is_staged_as_values(dtype):
    """An array in either byte order comes out with its values, in the device's native order."""
    values = np.arange(-3, 5).astype(dtype)
    with MicroBatchIterator([{"x": values}], device="cpu") as it:
        staged = next(it)["x"]
    np.testing.assert_array_equal(staged.numpy(), values.astype(values.dtype.newbyteorder("=")))


@pytest.mark.parametrize("slot_nbytes", [0, 4096])
def test_empty_micro_batches_are_delivered(slot_nbytes):
    """An empty micro-batch (an idle DP rank's) is delivered with its empty fields, between
    non-empty ones, whatever the initial slot size."""
    empty_layout = MicroBatchLayout.build({"tokens": ("int32", (0,))})
    items = [
        {"tokens": np.zeros(0, np.int32), "rows": np.zeros((0, 3), np.float32)},
        PackedMicroBatch(empty_layout, b""),
        {"tokens": np.arange(5, dtype=np.int32)},
        {"tokens": np.zeros(0, np.int32)},
    ]
    config = MicroBatchIterator.Config(slot_nbytes=slot_nbytes)
    with MicroBatchIterator(items, config, device="cpu") as it:
        shapes = [tuple(mb["tokens"].shape) for mb in it]
    assert shapes == [(0,), (0,), (5,), (0,)]


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (np.array(["a", "bc"]), "str"),
        (np.array([b"a"]), "bytes"),
        (np.array([object()]), "object"),
        (np.array(["2024-01-01"], dtype="datetime64[D]"), "datetime64"),
        (np.array([1], dtype="timedelta64[s]"), "timedelta64"),
        (np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]), "structured"),
    ],
)
def test_unsupported_dtypes_raise_naming_the_field(value, kind):
    """Strings, objects, datetimes and structured arrays cannot be staged as tensors: next()
    raises a ValueError naming the field and its dtype, never a raw numpy/torch error."""
    items = [{"tokens": np.ones(2), "bad_field": value}]
    with (
        MicroBatchIterator(items, device="cpu") as it,
        pytest.raises(ValueError, match=rf"field 'bad_field'.*{kind}"),
    ):
        next(it)


def test_unsupported_layout_dtype_raises_naming_the_field():
    """A packed item whose layout names a dtype torch cannot view is refused naming the field."""
    layout = MicroBatchLayout.build({"when": ("datetime64[s]", (2,))})
    items = [PackedMicroBatch(layout, bytes(layout.nbytes))]
    with (
        MicroBatchIterator(items, device="cpu") as it,
        pytest.raises(ValueError, match=r"field 'when'.*datetime64"),
    ):
        next(it)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "bfloat16"])
def test_torch_only_dtypes_keep_their_bits(dtype):
    """Tensors of dtypes numpy lacks (float8, bfloat16) travel bit for bit and keep their dtype."""
    torch_dtype = getattr(torch, dtype)
    value = torch.linspace(-2, 2, 8).to(torch_dtype)
    with MicroBatchIterator([{"x": value}], device="cpu") as it:
        staged = next(it)["x"]
    assert staged.dtype == torch_dtype
    assert torch.equal(staged.view(torch.uint8), value.view(torch.uint8))


def test_a_second_consumer_thread_is_refused():
    """One consumer per iterator: next() from a second thread raises instead of tearing,
    duplicating or dropping micro-batches; the owning thread continues undisturbed."""
    items = [{"x": np.full(4, i)} for i in range(6)]
    errors: list[BaseException] = []
    with MicroBatchIterator(items, device="cpu") as it:
        assert int(next(it)["x"][0]) == 0

        def intruder() -> None:
            try:
                next(it)
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=intruder)
        thread.start()
        thread.join(60)
        rest = [int(mb["x"][0]) for mb in it]
    assert rest == [1, 2, 3, 4, 5]
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "one consumer thread" in str(errors[0])
