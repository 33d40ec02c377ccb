"""A release looks for pages the rank wrote only where a write can have happened: after a page
fault of the process since the slot was last clean (issue 31; NOTE [ Written pages only after a
fault ] in knitkit/storage/delivery/slot_ring.py)."""

from __future__ import annotations

import mmap
import resource

import numpy as np
from ring_parts import BOUND_S, published_ring

from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.types import MicroBatchLayout

ROWS = (1 << 20) // 8
"""One MiB of int64 per micro-batch: 256 pages of 4 KiB."""
READS = "knitkit/delivery/page_map_reads"
MAX_RELEASES = 2000
"""Bound of the quiet-release search (about 0.1 ms per release of a 1 MiB slot)."""


def _publish(publisher: Publisher, value: int) -> None:
    layout = MicroBatchLayout.build({"x": ("int64", (ROWS,))})
    layout.numpy_views(publisher.acquire(layout.nbytes))["x"][:] = value
    publisher.publish(layout)


def test_a_written_lease_never_skips_the_page_map() -> None:
    """Once the ring is warm (every slot mapped, the producer's pages faulted in), a lease written
    through its private view is found and dropped at its release, so the writer reads the slot's
    next occupant exactly."""
    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 20, num_consumers=1)
    with published_ring(spec) as ring:
        publisher, consumer = ring.publisher, ring.consumers[0]
        value = 0

        def hand_out() -> np.ndarray:
            nonlocal value
            _publish(publisher, value)
            lease = consumer.next_micro_batch(timeout_s=BOUND_S)
            assert lease.private is not None
            x = np.frombuffer(lease.private(), np.int64)[:ROWS]
            assert x.min() == x.max() == value, f"micro-batch {value}"
            value += 1
            lease.release()
            return x

        for _ in range(4):  # warm: two laps
            hand_out()
        _publish(publisher, value)
        lease = consumer.next_micro_batch(timeout_s=BOUND_S)
        assert lease.private is not None
        written = np.frombuffer(lease.private(), np.int64)
        written[ROWS // 2] = -1  # one page written, in the middle of the slot
        before = consumer.metrics()[READS]
        lease.release()
        assert consumer.metrics()[READS] == before + 1, "a written lease skipped the page map"
        value += 1
        hand_out()  # the other slot
        after = hand_out()  # the written slot's next occupant: the shared bytes, not the write
        assert after[ROWS // 2] == value - 1
        del written, after


def test_every_page_of_a_slot_is_mapped_at_its_first_use() -> None:
    """A slot's pages are faulted in whole at its first hand-out, so a later, larger occupant
    maps nothing more: no populate and no page fault per micro-batch as sizes vary."""
    spec = RingSpec.new(num_slots=1, slot_bytes=64 * mmap.PAGESIZE, num_consumers=1)
    owner = SlotRing.create(spec)
    ring = SlotRing.attach(spec, read_only_slots=True)
    try:
        ring.private_slot(0, mmap.PAGESIZE)  # a small first occupant
        assert ring._private is not None
        address = np.frombuffer(ring._private, np.uint8, 1).ctypes.data
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(8 * (address // mmap.PAGESIZE))
            entries = np.frombuffer(pagemap.read(8 * 64), np.uint64)
        assert int(((entries >> 63) & 1).sum()) == 64, "the slot's later pages are not mapped"
    finally:
        ring.close()
        owner.close()
        owner.unlink()


def test_a_release_with_no_page_fault_since_its_slot_was_clean_reads_no_page_map() -> None:
    """Read-only hand-outs of one slot: wherever the process took no page fault between the
    slot's last clean point and the end of a release (other threads of the test process may
    fault at any time, so such releases are picked out, not assumed), that release read no page
    map; most releases of a quiet loop are such. At least 50 releases, more (up to
    ``MAX_RELEASES``) while none was quiet: a session's Ray runtime faults on threads of its own."""
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 20, num_consumers=1)
    owner = SlotRing.create(spec)
    ring = SlotRing.attach(spec, read_only_slots=True)
    try:
        quiet = 0
        for seq in range(MAX_RELEASES):
            if seq >= 50 and quiet:
                break
            x = np.frombuffer(ring.private_slot(seq, spec.slot_bytes), np.int64)
            assert int(x.max()) == 0  # every byte read, as the training step would
            del x
            clean, reads = ring._clean_at.get(0), ring.page_map_reads
            ring.drop_private(seq, spec.slot_bytes)
            if clean is not None and _faults() == clean:  # none since the clean point
                assert ring.page_map_reads == reads, f"release {seq} read the page map"
                quiet += 1
        assert quiet > 0, f"no release of {MAX_RELEASES} ran without a page fault of the process"
    finally:
        ring.close()
        owner.close()
        owner.unlink()


def _faults() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt
