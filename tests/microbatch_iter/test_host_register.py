"""HostRegistry: which mappings are page-locked in place, once each, unregistered on close.

The registry's bookkeeping runs against real /dev/shm mappings and this process's real
/proc/self/maps; the CUDA runtime calls sit behind the ``PageLocker`` seam, recorded here (the
real calls are exercised by tests/microbatch_iter/test_cuda.py on a GPU).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from knitkit.microbatch_iter.host_register import HostRegistry, mapping_of

PAGE = 4096
LOGGER = "knitkit.microbatch_iter.host_register"


class RecordingLocker:
    """Records register / unregister calls; ``fail_with`` makes registration return that code."""

    def __init__(self, fail_with: int = 0) -> None:
        self.fail_with = fail_with
        self.registered: list[tuple[int, int, bool]] = []
        self.unregistered: list[int] = []

    def register(self, address: int, nbytes: int, *, read_only: bool) -> int:
        self.registered.append((address, nbytes, read_only))
        return self.fail_with

    def unregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0

    def describe(self, code: int) -> str:
        return f"cudaErrorHostMemoryAlreadyRegistered ({code})"


@pytest.fixture
def ring() -> Iterator[shared_memory.SharedMemory]:
    """A /dev/shm segment of four 4 KiB slots, as a reorganizer's ring would be mapped."""
    segment = shared_memory.SharedMemory(f"knitkit-test-{uuid.uuid4().hex[:12]}", True, 4 * PAGE)
    yield segment
    segment.unlink()
    segment.close()


def slots(segment: shared_memory.SharedMemory) -> list[np.ndarray]:
    assert segment.buf is not None
    whole = np.frombuffer(segment.buf, np.uint8)
    return [whole[i * PAGE : (i + 1) * PAGE] for i in range(4)]


def address(view: np.ndarray) -> int:
    return int(view.__array_interface__["data"][0])


def test_mapping_of_tells_a_shared_ring_from_private_memory(ring):
    """A /dev/shm segment is one shared mapping named by its path that holds every slot; a numpy
    array lives in private memory."""
    views = slots(ring)
    mapping = mapping_of(address(views[2]))
    assert mapping is not None and mapping.shared and mapping.writable
    assert mapping.path == f"/dev/shm/{ring.name}"
    assert all(mapping.holds(address(v), v.nbytes) for v in views)
    heap = np.ones(1 << 20, np.uint8)
    private = mapping_of(address(heap))
    assert private is not None and not private.shared
    del views


def test_a_ring_is_registered_once_whole_and_unregistered_on_close(ring):
    """Every slot of one ring maps to ONE registration of the whole mapping (page-aligned start,
    its full size), private memory is never registered, and close() unregisters exactly what was
    registered."""
    locker = RecordingLocker()
    registry = HostRegistry(locker)
    views = slots(ring)
    assert all(registry.page_locked(v) for v in views + views)
    mapping = mapping_of(address(views[0]))
    assert mapping is not None
    assert locker.registered == [(mapping.start, mapping.end - mapping.start, False)]
    assert mapping.start % PAGE == 0 and mapping.end - mapping.start >= 4 * PAGE
    assert not registry.page_locked(np.ones(1 << 20, np.uint8))  # private: staged instead
    assert len(locker.registered) == 1
    registry.close()
    assert locker.unregistered == [mapping.start] and registry.registered == []
    registry.close()  # idempotent
    assert locker.unregistered == [mapping.start]
    del views


def test_a_refused_registration_logs_one_line_and_is_not_retried(ring, caplog):
    """When cudaHostRegister fails (here: already registered by someone else), the slots of that
    ring are staged instead: one warning naming the mapping and the CUDA error, no second
    attempt for later slots, nothing to unregister on close."""
    locker = RecordingLocker(fail_with=712)
    registry = HostRegistry(locker)
    views = slots(ring)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not any(registry.page_locked(v) for v in views + views)
    assert len(locker.registered) == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == LOGGER]
    assert len(warnings) == 1 and len(warnings[0].getMessage().splitlines()) == 1
    assert ring.name in warnings[0].getMessage() and "(712)" in warnings[0].getMessage()
    registry.close()
    assert locker.unregistered == []
    del views


@pytest.mark.skipif(
    torch.cuda.device_count() > 0,
    reason="a CUDA GPU is present, so registration succeeds here; test_cuda.py covers that path",
)
def test_without_cuda_registration_falls_back_without_raising(ring, caplog):
    """With the real CUDA runtime calls and no usable CUDA (a CPU build of torch), registering a
    ring fails softly: not page-locked, one warning, no exception."""
    registry = HostRegistry()
    views = slots(ring)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert not registry.page_locked(views[0])
        assert not registry.page_locked(views[1])
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and "staging its slots" in records[0].getMessage()
    registry.close()
    del views


def test_a_source_of_fresh_private_arrays_stops_the_lookups():
    """Fresh arrays land in new private mappings; after a few lookups a registry that registered
    nothing stops reading /proc/self/maps for every micro-batch (bounded bookkeeping, no calls)."""
    locker = RecordingLocker()
    registry = HostRegistry(locker)
    arrays = [np.ones(4 << 20, np.uint8) for _ in range(40)]  # 4 MiB each: separate mmaps
    assert not any(registry.page_locked(a) for a in arrays)
    assert len(registry.refused) <= 8 and locker.registered == []
