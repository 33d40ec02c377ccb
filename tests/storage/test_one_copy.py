"""One copy per delivered byte: a TP rank reads its ring's slots in place through ONE private
mapping, mapped and faulted in once per slot, not per micro-batch (issue 31.1; NOTE [ Zero-copy
hand-off ] in knitkit/microbatch_iter/worker.py)."""

from __future__ import annotations

import mmap

import numpy as np

from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.types import MicroBatchLayout

PAGE = mmap.PAGESIZE
ROWS = (1 << 20) // 8
"""One MiB of int64 per micro-batch: 256 pages of 4 KiB."""


def _publish(publisher: Publisher, value: int) -> None:
    layout = MicroBatchLayout.build({"x": ("int64", (ROWS,))}, extra={"value": value})
    layout.numpy_views(publisher.acquire(layout.nbytes))["x"][:] = value
    publisher.publish(layout)


def _mapped_pages(mapping: mmap.mmap, start: int, nbytes: int) -> int:
    """How many pages of ``mapping[start : start + nbytes]`` this process has in its page table
    (/proc/self/pagemap's present bit)."""
    address = np.frombuffer(mapping, np.uint8, 1).ctypes.data + start
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(8 * (address // PAGE))
        entries = np.frombuffer(pagemap.read(8 * (nbytes // PAGE)), np.uint64)
    return int(((entries >> 63) & 1).sum())


def test_steady_state_hand_outs_change_no_page_table() -> None:
    """The rank maps its ring once and keeps every slot's pages mapped across occupants: after
    each release of a read-only micro-batch all 256 pages of its slot are still in the page table
    (a private mapping dropped per micro-batch unmapped them, and populated them again for the
    next occupant: 143 us/MiB, issue 31), and every occupant reads back exactly."""
    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 20, num_consumers=1)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=60.0)
    try:
        for value in range(8):
            _publish(publisher, value)
            lease = consumer.next_micro_batch(timeout_s=60.0)
            assert lease.private is not None
            x = np.frombuffer(lease.private(), np.int64)[:ROWS]
            assert x.min() == x.max() == value  # every byte read, as the training step would
            del x
            lease.release()
            mapping = consumer._ring._private
            assert mapping is not None
            start = (value % 2) * spec.slot_bytes
            assert _mapped_pages(mapping, start, 1 << 20) == 256, f"micro-batch {value}"
    finally:
        consumer.close()
        owner.request_stop()
        publisher.close()
        owner.close()
        owner.unlink()


def test_written_pages_are_found_from_the_page_map() -> None:
    """Pages of a private file mapping read or never touched count as unwritten; the span covers
    exactly the first to the last page this process wrote; a shared write is not ours."""
    from knitkit.storage.delivery.written_pages import WrittenPages  # new in issue 31

    spec = RingSpec.new(num_slots=1, slot_bytes=16 * PAGE, num_consumers=1)
    owner = SlotRing.create(spec)
    ring = SlotRing.attach(spec)
    try:
        view = np.frombuffer(ring.private_slot(0, 16 * PAGE), np.uint8)
        pages = WrittenPages(ring._private)  # the mapping private_slot made
        assert int(view[: 8 * PAGE].sum()) == 0  # read: still the file's pages
        owner.slot(0, 16 * PAGE)[PAGE] = 1  # the producer's write, through the shared mapping
        assert pages.span(0, 16 * PAGE) is None
        view[3 * PAGE + 5] = 7
        view[9 * PAGE] = 7
        assert pages.span(0, 16 * PAGE) == (3 * PAGE, 7 * PAGE)
        assert pages.span(10 * PAGE, 6 * PAGE) is None
        ring.drop_private(0, 16 * PAGE)  # the release: private copies go, shared bytes show
        assert pages.span(0, 16 * PAGE) is None
        assert view[3 * PAGE + 5] == 0 and view[PAGE] == 1
        del view
        pages.close()
    finally:
        ring.close()
        owner.close()
        owner.unlink()
