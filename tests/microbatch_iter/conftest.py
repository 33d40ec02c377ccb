"""Sources shared by the micro-batch iterator tests: a counting source and a shared-memory reorganizer."""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest

from knitkit.microbatch_iter import PackedMicroBatch
from knitkit.types import MicroBatchLayout


def fields_for(index: int, tokens: int) -> dict[str, np.ndarray]:
    """Deterministic fields of micro-batch ``index``: every value encodes the index."""
    return {
        "tokens": np.arange(tokens, dtype=np.int32) + index * 1000,
        "logprobs": np.full((tokens,), -float(index), dtype=np.float32),
        "routing": np.full((tokens, 2, 4), index % 251, dtype=np.uint8),
    }


class CountingSource:
    """Yields ``fields_for(i, sizes[i % len(sizes)])`` and counts how far it has been pulled."""

    def __init__(self, count: int, sizes: tuple[int, ...] = (64,)) -> None:
        self.count = count
        self.sizes = sizes
        self.pulled = 0
        self.closed = False

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.pulled >= self.count:
            raise StopIteration
        self.pulled += 1
        i = self.pulled - 1
        return fields_for(i, self.sizes[i % len(self.sizes)])

    def close(self) -> None:
        self.closed = True


class ShmReorganizer:
    """A reorganizer stand-in: a producer thread packs each micro-batch into ONE reused /dev/shm slot.

    The producer packs micro-batch ``i + 1`` into the same slot the moment micro-batch ``i`` is
    released, so a consumer that read the slot after releasing it would see the wrong data.
    """

    def __init__(self, count: int, tokens: int = 256) -> None:
        self.count = count
        self.tokens = tokens
        nbytes = self._layout(0).nbytes
        self.shm = shared_memory.SharedMemory(
            name=f"knitkit-test-{uuid.uuid4().hex[:12]}", create=True, size=nbytes
        )
        self.free = threading.Semaphore(1)
        self.published: queue.Queue[PackedMicroBatch] = queue.Queue()
        self.released = 0
        self.stopping = threading.Event()
        self.producer = threading.Thread(target=self._produce, daemon=True)
        self.producer.start()

    def _layout(self, i: int) -> MicroBatchLayout:
        fields = fields_for(i, self.tokens)
        specs = {name: (a.dtype.name, a.shape) for name, a in fields.items()}
        return MicroBatchLayout.build(specs, extra={"micro_batch": i})

    def _produce(self) -> None:
        for i in range(self.count):
            if not self.free.acquire(timeout=10) or self.stopping.is_set():
                return
            layout = self._layout(i)
            views = layout.numpy_views(self.shm.buf)
            for name, array in fields_for(i, self.tokens).items():
                np.copyto(views[name], array)
            del views
            item = PackedMicroBatch(layout, self.shm.buf[: layout.nbytes], on_release=self._release)
            self.published.put(item)

    def __iter__(self) -> Iterator[PackedMicroBatch]:
        for _ in range(self.count):
            yield self.published.get(timeout=10)

    def _release(self) -> None:
        self.released += 1
        self.free.release()

    def unlink(self) -> None:
        """Stop the producer, drop what it published but nobody took (views of the slot), unlink."""
        self.stopping.set()
        self.free.release()  # wakes a producer waiting for the slot
        self.producer.join(timeout=10)
        while not self.published.empty():
            self.published.get_nowait()
        self.shm.unlink()


@pytest.fixture
def expected_fields() -> Callable[[int, int], dict[str, np.ndarray]]:
    return fields_for


@pytest.fixture
def counting_source() -> Callable[..., CountingSource]:
    return CountingSource


@pytest.fixture
def shm_reorganizer() -> Iterator[Callable[..., ShmReorganizer]]:
    made: list[ShmReorganizer] = []

    def make(count: int, tokens: int = 256) -> ShmReorganizer:
        made.append(ShmReorganizer(count, tokens))
        return made[-1]

    yield make
    for reorganizer in made:
        reorganizer.unlink()
