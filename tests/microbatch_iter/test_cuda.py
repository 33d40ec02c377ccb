"""MicroBatchIterator on CUDA: stream/event hand-off under slow kernels, buffer lifetimes, exposed wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from knitkit.microbatch_iter import CudaTransport, MicroBatchIterator

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MiB = 1 << 20


@pytest.fixture(scope="module")
def sleep_ms():
    """``sleep_ms(ms)`` enqueues a kernel that spins for about ``ms`` on the current stream."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)
    return lambda ms: torch.cuda._sleep(int(ms * cycles_per_ms))


def filled(index: int, nbytes: int) -> dict[str, np.ndarray]:
    return {"x": np.full(nbytes // 4, index, dtype=np.int32)}


def test_slot_is_not_refilled_while_a_slow_kernel_still_has_to_read_it(sleep_ms):
    """The side stream waits on the consumed event: queued slow kernels read their own micro-batch."""
    n, nbytes = 24, 4 * MiB
    sums = []
    with MicroBatchIterator((filled(i, nbytes) for i in range(n)), device="cuda") as it:
        for mb in it:
            sleep_ms(20)  # the host runs far ahead of the GPU; the ring comes round meanwhile
            sums.append(mb["x"].sum(dtype=torch.int64))
    torch.cuda.synchronize()
    assert [int(s) for s in sums] == [i * (nbytes // 4) for i in range(n)]


def test_compute_waits_for_a_slow_host_to_device_copy(sleep_ms):
    """The compute stream waits on h2d_done: reads right after next() see the new bytes."""
    side_ready = threading.Event()
    holder: dict[str, torch.cuda.Stream] = {}

    def source() -> Iterator[dict[str, np.ndarray]]:
        side_ready.wait(10)
        for i in range(12):
            with torch.cuda.stream(holder["side"]):
                sleep_ms(30)  # delays this micro-batch's copy on the side stream
            yield filled(i, 8 * MiB)

    firsts = []
    with MicroBatchIterator(source(), device="cuda") as it:
        transport = it.pool.transport
        assert isinstance(transport, CudaTransport)
        holder["side"] = transport.side
        side_ready.set()
        for mb in it:
            firsts.append(mb["x"][-1].clone())
    torch.cuda.synchronize()
    assert [int(x) for x in firsts] == list(range(12))


def test_growing_slots_never_free_a_buffer_a_queued_kernel_reads(sleep_ms):
    """Slots regrow while slow kernels still read their old blocks; the freed side-stream blocks
    are handed to the next growth (same sizes), yet every kernel reads its own micro-batch."""
    sizes = [4, 2, 1, 8, 4, 2, 16, 8, 4, 32, 16, 8]
    sums = []
    source = (filled(i, s * MiB) for i, s in enumerate(sizes))
    with MicroBatchIterator(source, MicroBatchIterator.Config(depth=2), device="cuda") as it:
        for mb in it:
            sleep_ms(15)
            sums.append(mb["x"].sum(dtype=torch.int64))
    torch.cuda.synchronize()
    assert [int(s) for s in sums] == [i * s * MiB // 4 for i, s in enumerate(sizes)]


def test_pool_buffers_are_pinned_and_copies_timed():
    """Host slots are page-locked; with time_h2d the copies' device time is reported after close."""
    config = MicroBatchIterator.Config(depth=2, slot_nbytes=8 * MiB, time_h2d=True)
    with MicroBatchIterator((filled(i, 8 * MiB) for i in range(6)), config, device="cuda") as it:
        assert all(slot.host is not None and slot.host.is_pinned() for slot in it.pool.slots)
        assert all(mb["x"].is_cuda for mb in it)
    assert it.stats.h2d_s > 0
    assert it.pool.allocations == 3


def test_exposed_wait_is_near_zero_when_compute_exceeds_preparation(sleep_ms):
    """With 10 ms of compute per micro-batch and ~2 ms of preparation, steady waits vanish."""
    n = 30

    def prepare() -> Iterator[dict[str, np.ndarray]]:
        payload = np.random.default_rng(0).integers(0, 100, 4 * MiB // 4, dtype=np.int32)
        for i in range(n):
            time.sleep(0.001)
            yield {"x": payload + i}  # a real 4 MiB pack per micro-batch

    with MicroBatchIterator(prepare(), device="cuda") as it:
        for mb in it:
            sleep_ms(10)
            mb["x"].sum()
            torch.cuda.current_stream().synchronize()  # a loss.item() per step
    assert it.stats.steady_wait_s / (n - 1) < 0.1 * 0.010
