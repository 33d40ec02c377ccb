"""``MicroBatchIterator(convert=...)``: the conversion runs on the prefetch thread, ahead of ``next()``.

See NOTE [ Conversion on the prefetch thread ] in knitkit/microbatch_iter/iterator.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from knitkit.microbatch_iter import MicroBatch, MicroBatchIterator, PackedMicroBatch
from knitkit.types import MicroBatchLayout


def test_convert_runs_on_the_prefetch_thread_ahead_of_next(counting_source, expected_fields):
    """Each ``next()`` returns ``convert(micro_batch)`` in order, computed on the prefetch thread
    (never the training thread) before the loop asked for it."""
    converted = threading.Event()
    threads: list[str] = []

    def convert(micro_batch: MicroBatch) -> dict[str, object]:
        threads.append(threading.current_thread().name)
        converted.set()
        return {"index": micro_batch.index, "tokens": micro_batch["tokens"].clone()}

    config = MicroBatchIterator.Config(depth=2)
    with config.build(counting_source(5), device="cpu", convert=convert) as iterator:
        assert converted.wait(30), "the prefetch thread converted nothing before next()"
        batches = list(iterator)
    assert [b["index"] for b in batches] == list(range(5))
    for i, batch in enumerate(batches):
        expected = expected_fields(i, 64)["tokens"]
        assert np.array_equal(batch["tokens"].numpy(), expected)
    assert len(threads) == 5
    assert threading.current_thread().name not in threads
    assert all(name.startswith("knitkit-microbatch-prefetch") for name in threads)
    assert iterator.stats.count == 5


def test_a_failing_conversion_raises_in_next_and_returns_its_lease():
    """A conversion that raises ends the thread: the loop's ``next()`` raises its error, and the
    zero-copy lease of the micro-batch it failed on goes back at once (nothing is left held)."""
    layout = MicroBatchLayout.build({"tokens": ("int32", (8,))})
    buffers = [bytearray(layout.nbytes) for _ in range(3)]
    for buffer in buffers:
        layout.numpy_views(memoryview(buffer))["tokens"][:] = np.arange(8)
    released: list[int] = []

    def items():
        for i, buffer in enumerate(buffers):
            yield PackedMicroBatch(
                layout,
                memoryview(buffer),
                on_release=lambda i=i: released.append(i),
                private=lambda buffer=buffer: memoryview(buffer),
            )

    def convert(micro_batch: MicroBatch) -> torch.Tensor:
        if micro_batch.index == 1:
            raise ValueError("micro-batch 1 cannot be converted")
        return micro_batch["tokens"]

    iterator = MicroBatchIterator(items(), MicroBatchIterator.Config(depth=1), convert=convert)
    with iterator:
        assert torch.equal(next(iterator), torch.arange(8, dtype=torch.int32))
        with pytest.raises(ValueError, match="micro-batch 1 cannot be converted"):
            next(iterator)
    assert sorted(released) == [0, 1]
