"""MicroBatchIterator on CUDA: stream/event hand-off under slow kernels, buffer lifetimes, exposed
wait, and device copies read straight from a page-locked /dev/shm ring (NOTE [ Registered source
rings ])."""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from knitkit.microbatch_iter import CudaTransport, MicroBatchIterator, PackedMicroBatch
from knitkit.microbatch_iter.host_register import CudartPageLocker, mapping_of
from knitkit.types import MicroBatchLayout

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine",
    ),
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


class OneSlotRing:
    """A reorganizer stand-in over ONE /dev/shm slot: micro-batch ``i`` (int32 values ``i``) is
    packed into it once the previous one is released, and a released slot is scribbled over
    (-1) at once, so a device copy that read the slot after its release delivers -1s."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.count = count
        self.layout = MicroBatchLayout.build({"x": ("int32", (nbytes // 4,))})
        self.shm = shared_memory.SharedMemory(f"knitkit-test-{uuid.uuid4().hex[:12]}", True, nbytes)
        self.free = threading.Semaphore(1)
        self.before_publish: Callable[[], None] = lambda: None
        self.on_release: Callable[[], None] = lambda: None
        self.released = 0

    def view(self) -> np.ndarray:
        assert self.shm.buf is not None
        return np.frombuffer(self.shm.buf, np.int32, self.layout.nbytes // 4)

    def __iter__(self) -> Iterator[PackedMicroBatch]:
        for i in range(self.count):
            assert self.free.acquire(timeout=60), "the iterator never released the slot"
            self.view()[:] = i
            self.before_publish()
            assert self.shm.buf is not None
            yield PackedMicroBatch(self.layout, self.shm.buf[: self.layout.nbytes], self._release)

    def _release(self) -> None:
        self.on_release()
        self.view()[:] = -1
        self.released += 1
        self.free.release()

    def pinned(self) -> bool:
        """Whether the ring's pages are page-locked (registered) right now."""
        return torch.from_numpy(self.view()).is_pinned()

    def close(self) -> None:
        gc.collect()  # the finished generator's views
        self.shm.unlink()
        with contextlib.suppress(BufferError):  # a view still held: the mapping goes at exit
            self.shm.close()


@pytest.fixture
def one_slot_ring() -> Iterator[Callable[[int, int], OneSlotRing]]:
    made: list[OneSlotRing] = []

    def make(count: int, nbytes: int) -> OneSlotRing:
        made.append(OneSlotRing(count, nbytes))
        return made[-1]

    yield make
    for ring in made:
        ring.close()


def expect_values(delivered: list[torch.Tensor], count: int) -> None:
    torch.cuda.synchronize()
    for i, x in enumerate(delivered):
        assert torch.equal(x, torch.full_like(x, i)), f"micro-batch {i} has the wrong bytes"
    assert len(delivered) == count


def test_device_copy_reads_the_published_slot_in_place_bit_exact(one_slot_ring):
    """A published /dev/shm slot is copied to the device straight from the slot: the ring is
    page-locked once, no pinned staging slot is allocated, and every micro-batch arrives with
    exactly the bytes the producer published (the slot is scribbled over after each release)."""
    ring = one_slot_ring(16, 4 * MiB)
    delivered = []
    with MicroBatchIterator(ring, MicroBatchIterator.Config(depth=2), device="cuda") as it:
        transport = it.pool.transport
        assert isinstance(transport, CudaTransport) and transport.registry is not None
        for mb in it:
            assert ring.pinned() and len(transport.registry.registered) == 1
            delivered.append(mb["x"].clone())
        assert it.pool.allocations == 0  # no pinned staging slot: one host copy fewer
    expect_values(delivered, 16)
    assert ring.released == 16


def test_slot_is_released_only_after_its_copy_event_completed(one_slot_ring, sleep_ms):
    """Each copy is delayed on the side stream by a 30 ms kernel; the slot must not go back to
    the producer (which scribbles over it) before that copy finished: the side stream is idle
    at every release and the delivered bytes are the published ones."""
    ring = one_slot_ring(10, 8 * MiB)
    side_ready = threading.Event()
    holder: dict[str, torch.cuda.Stream] = {}
    busy_at_release = []

    def delay_copy() -> None:
        assert side_ready.wait(60)
        with torch.cuda.stream(holder["side"]):
            sleep_ms(30)

    ring.before_publish = delay_copy
    ring.on_release = lambda: busy_at_release.append(not holder["side"].query())
    delivered = []
    with MicroBatchIterator(ring, MicroBatchIterator.Config(depth=2), device="cuda") as it:
        transport = it.pool.transport
        assert isinstance(transport, CudaTransport)
        holder["side"] = transport.side
        side_ready.set()
        for mb in it:
            delivered.append(mb["x"][-4:].clone())
    expect_values(delivered, 10)
    assert busy_at_release == [False] * 10


def test_close_unregisters_the_ring(one_slot_ring):
    """The ring stays page-locked while the iterator runs and is unregistered by close(), even
    mid-stream: cudaHostUnregister then reports it as not registered."""
    ring = one_slot_ring(8, 1 * MiB)
    it = MicroBatchIterator(ring, MicroBatchIterator.Config(depth=2), device="cuda")
    first = next(it)["x"][:4].clone()
    assert ring.pinned()
    mapping = mapping_of(int(ring.view().__array_interface__["data"][0]))
    assert mapping is not None
    it.close()
    assert not ring.pinned()
    assert CudartPageLocker().unregister(mapping.start) != 0  # not registered any more
    torch.zeros(1, device="cuda")  # no stale CUDA error left behind by that call
    expect_values([first], 1)


def test_a_ring_registered_elsewhere_is_staged_through_pinned_memory(one_slot_ring, caplog):
    """If the ring cannot be registered (here: someone else already page-locked it), the iterator
    logs one line and stages every micro-batch through pinned slots, with the right bytes, and
    later kernels of the prefetch thread (a source that collates on the GPU) see no stale CUDA
    error from the failed call."""
    ring = one_slot_ring(12, 2 * MiB)
    ring.before_publish = lambda: torch.ones(4, device="cuda").add_(1).sum()  # in the thread
    mapping = mapping_of(int(ring.view().__array_interface__["data"][0]))
    assert mapping is not None
    locker = CudartPageLocker()
    assert locker.register(mapping.start, mapping.end - mapping.start, read_only=False) == 0
    try:
        delivered = []
        with caplog.at_level(logging.INFO, logger="knitkit.microbatch_iter.host_register"):
            with MicroBatchIterator(ring, MicroBatchIterator.Config(depth=2), device="cuda") as it:
                for mb in it:
                    delivered.append((mb["x"][:4] * 1).clone())  # kernels after the failure
            assert it.pool.allocations == 3
        expect_values(delivered, 12)
        warnings = [
            r
            for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "knitkit.microbatch_iter.host_register"
        ]
        assert len(warnings) == 1 and ring.shm.name in warnings[0].getMessage()
        assert ring.pinned()  # the other user's registration is left alone
    finally:
        assert locker.unregister(mapping.start) == 0


def test_register_host_false_keeps_the_pinned_staging_copy(one_slot_ring):
    """``register_host=False`` copies every micro-batch into a pinned staging slot first and
    never page-locks the ring."""
    ring = one_slot_ring(6, 1 * MiB)
    config = MicroBatchIterator.Config(depth=2, register_host=False)
    delivered = []
    with MicroBatchIterator(ring, config, device="cuda") as it:
        for mb in it:
            assert not ring.pinned()
            delivered.append(mb["x"].clone())
        assert it.pool.allocations == 3
    expect_values(delivered, 6)
