"""StagingRing (the iterator's staging buffers): round-robin slots that grow to powers of two and are otherwise reused."""

from __future__ import annotations

import pytest

from knitkit.microbatch_iter import CpuTransport, StagingRing


def test_slots_grow_to_powers_of_two_and_are_reused():
    """A slot reallocates only for a larger size, to the next power of two; smaller ones reuse it."""
    ring = StagingRing(2, CpuTransport())
    slot = ring.slot_for(0)
    ring.ensure(slot, 1000)
    first = slot.host
    assert slot.capacity == 1024 and ring.allocations == 1
    ring.ensure(slot, 1024)
    ring.ensure(slot, 3)
    assert slot.host is first and ring.allocations == 1
    ring.ensure(slot, 1025)
    assert slot.capacity == 2048 and ring.allocations == 2


def test_round_robin_and_held_bytes_count_cpu_slots_once():
    """Micro-batch j uses slot j % count; a CPU slot's device twin is its host buffer."""
    ring = StagingRing(3, CpuTransport(), initial_nbytes=4096)
    assert [ring.slot_for(j).index for j in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert all(slot.device is slot.host for slot in ring.slots)
    assert ring.held_bytes == 3 * 4096 and ring.allocations == 3
    ring.clear()
    assert ring.held_bytes == 0


def test_empty_ring_is_refused():
    """A ring needs at least one slot."""
    with pytest.raises(ValueError, match="count=0"):
        StagingRing(0, CpuTransport())
