"""The prefetch thread's in-place device copy (NOTE [ Registered source rings ]) on CPU.

``CopyEngineTransport`` stands in for CudaTransport's copy engine where there is no GPU: each
device copy runs on an engine thread some milliseconds after it is issued, and completes an
event, like a ``non_blocking`` copy on a side stream. The real CUDA path is tested by
tests/microbatch_iter/test_cuda.py on a GPU; this file checks the iterator's side of the
contract with real threads and a real /dev/shm producer.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
import torch

import knitkit.microbatch_iter.iterator as iterator_module
from knitkit.microbatch_iter import MicroBatchIterator

WAIT_S = 60.0


class CopyEngineTransport:
    """Copies host -> "device" (a separate CPU buffer) on an engine thread, ``delay_s`` after
    issue; ``done[slot]`` is set when the slot's copy has finished reading its source."""

    copies_to_device = True

    def __init__(self, slots: int, delay_s: float) -> None:
        self.device = torch.device("cpu")
        self.h2d_seconds = 0.0
        self.delay_s = delay_s
        self.done = [threading.Event() for _ in range(slots)]
        for event in self.done:
            event.set()
        self.copies = 0
        self._jobs: queue.SimpleQueue[tuple[int, torch.Tensor, torch.Tensor] | None]
        self._jobs = queue.SimpleQueue()
        self._engine = threading.Thread(target=self._run, daemon=True)
        self._engine.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            slot, source, target = job
            time.sleep(self.delay_s)
            target.copy_(source)
            self.copies += 1
            self.done[slot].set()

    def enter_worker(self) -> None:
        pass

    def new_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def new_device(self, nbytes: int, host: torch.Tensor | None) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def reads_in_place(self, view: np.ndarray) -> bool:
        return True

    def before_refill(self, slot: int) -> None:
        assert self.done[slot].wait(WAIT_S)

    def to_device(self, slot: int, host: torch.Tensor, device: torch.Tensor, nbytes: int) -> None:
        self.done[slot].clear()
        self._jobs.put((slot, host[:nbytes], device[:nbytes]))

    def wait_copy(self, slot: int) -> None:
        assert self.done[slot].wait(WAIT_S)

    def hand_over(self, slot: int) -> None:
        assert self.done[slot].wait(WAIT_S)  # CUDA: a device-side wait on the copy's event

    def release(self, slot: int) -> None:
        pass

    def close(self) -> None:
        self._jobs.put(None)
        self._engine.join(WAIT_S)


@pytest.fixture
def copy_engine(monkeypatch) -> list[CopyEngineTransport]:
    """Every iterator built in the test gets a CopyEngineTransport with 5 ms copies."""
    made: list[CopyEngineTransport] = []

    def make(device, slots, **_):
        made.append(CopyEngineTransport(slots, delay_s=0.005))
        return made[-1]

    monkeypatch.setattr(iterator_module, "make_transport", make)
    return made


def test_in_place_copy_releases_the_slot_only_after_the_copy_finished(
    copy_engine, shm_reorganizer, expected_fields
):
    """The copy reads the published slot itself (no host staging buffer) and the slot goes back
    to the producer only once that copy has finished: the producer repacks the ONE slot at
    release, so an early release would deliver the next micro-batch's bytes. With a single
    published slot and depth 2, the thread hands it back before pulling again (no deadlock)."""
    count = 12
    reorganizer = shm_reorganizer(count)
    config = MicroBatchIterator.Config(depth=2)
    with MicroBatchIterator(reorganizer, config, device="cpu") as it:
        for mb in it:
            for name, expected in expected_fields(mb.index, 256).items():
                assert np.array_equal(mb[name].numpy(), expected), (mb.index, name)
            assert mb.flat.data_ptr() != 0
        assert it.pool.allocations == 0  # no pinned staging slot: one host copy fewer
    assert copy_engine[0].copies == count
    assert reorganizer.released == count


def test_close_mid_stream_waits_for_copies_and_releases_every_slot(copy_engine, shm_reorganizer):
    """close() after the first micro-batch waits for the copies in flight and hands back every
    slot the thread pulled: the producer gets as many releases as items were pulled."""
    reorganizer = shm_reorganizer(10)
    pulled = []

    def source():
        for item in reorganizer:
            pulled.append(item.layout.extra["micro_batch"])  # no view of the slot kept
            yield item

    it = MicroBatchIterator(source(), MicroBatchIterator.Config(depth=2), device="cpu")
    assert next(it).index == 0
    it.close()
    assert len(pulled) >= 1 and reorganizer.released == len(pulled)
    assert all(event.is_set() for event in copy_engine[0].done)
