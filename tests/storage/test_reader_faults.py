"""Shared-memory readers and reorganizers take no page faults in the steady state (NOTE [ Populated mappings ])."""

from __future__ import annotations

import errno
import mmap
import os
import pickle
import resource
import threading

import numpy as np
import pytest
from delivery_payloads import fill_backend, make_metas, plan_for, real_tokens

from knitkit.storage.backends.lost import UnitsLostError
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.backends.slab import MADV_POPULATE_READ
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer import Reorganizer
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.storage.planning.plan import Topology
from knitkit.types import UnitKey, UnitRead

UNIT_ROWS = 1 << 16
"""int64 rows of one test unit: 512 KiB, 128 pages (8 first-touch faults with fault-around)."""


def _populate_supported() -> bool:
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        probe.madvise(MADV_POPULATE_READ, 0, mmap.PAGESIZE)
    except OSError as exc:
        return exc.errno != errno.EINVAL
    finally:
        probe.close()
    return True


pytestmark = pytest.mark.skipif(
    not _populate_supported(), reason="the kernel has no MADV_POPULATE_* (Linux < 5.14)"
)


def _faults() -> int:
    """Minor page faults of the calling thread so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _unit(index: int) -> np.ndarray:
    return np.arange(UNIT_ROWS, dtype=np.int64) * 7 + index


def _outs(count: int) -> list[np.ndarray]:
    """Destinations whose pages are already faulted in (a reorganizer's ring slots are)."""
    return [np.full(UNIT_ROWS, -1, dtype=np.int64) for _ in range(count)]


def test_a_reader_takes_no_page_faults_on_units_it_never_read() -> None:
    """A reader (a reorganizer's pickled copy of the store) that has read once reads units it
    never touched without page faults: its mapping of every slab was populated up to the slab's
    high-water mark at that first read, as a long-lived reorganizer's mapping is in a job's
    steady state, where new units reuse freed extents. Units put after that are mapped at the
    reader's next read, once. Bytes are those put (the old path mapped each new unit's pages at
    its first read: 8 faults per 512 KiB unit, ~120 here)."""
    owner = SharedMemoryBackend(slab_bytes=32 << 20)
    try:
        keys = [UnitKey(f"t{i}", "tokens") for i in range(16)]
        for i, key in enumerate(keys):
            owner.put(key, _unit(i))
        reader = pickle.loads(pickle.dumps(owner))
        outs = _outs(24)
        reader.read_many([UnitRead(keys[0])], outs[:1])  # its first read
        before = _faults()
        for key, out in zip(keys[1:], outs[1:16], strict=True):
            reader.read_many([UnitRead(key)], [out])
        first_units = _faults() - before
        later = [UnitKey(f"t{i}", "tokens") for i in range(16, 24)]
        for i, key in enumerate(later, start=16):
            owner.put(key, _unit(i))  # the slab's high-water mark moves
        reader.read_many([UnitRead(later[0])], outs[16:17])  # maps the new extent once
        before = _faults()
        reader.read_many([UnitRead(k) for k in later[1:]], outs[17:])
        later_units = _faults() - before
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out, _unit(i))
        assert first_units <= 4, f"{first_units} page faults reading 15 units never read before"
        assert later_units <= 4, f"{later_units} page faults reading 7 units put later"
        reader.close()
    finally:
        owner.close()


def test_a_populated_reader_reads_a_reused_extent_as_its_new_unit() -> None:
    """A unit deleted and another put in its extent after a reader's mapping was populated: the
    reader reads the new unit's bytes there (``read_many``, ``read`` and ``view`` alike), and the
    old key is refused with a KeyError naming it, never read as the new unit's bytes: the pages
    are the slab's shared pages and the journal stays the reader's only index."""
    owner = SharedMemoryBackend(slab_bytes=8 << 20)
    try:
        old, new = UnitKey("old", "tokens"), UnitKey("new", "tokens")
        owner.put(UnitKey("kept", "tokens"), _unit(0))
        owner.put(old, _unit(1))
        used = owner.used_bytes
        reader = pickle.loads(pickle.dumps(owner))
        out = _outs(1)[0]
        reader.read_many([UnitRead(old)], [out])
        np.testing.assert_array_equal(out, _unit(1))
        owner.delete(old)
        owner.put(new, _unit(2))
        assert owner.used_bytes == used  # first fit: the new unit took the old one's extent
        with pytest.raises(KeyError, match="old/tokens"):
            reader.read_many([UnitRead(old)], [out])
        reader.read_many([UnitRead(new)], [out])
        np.testing.assert_array_equal(out, _unit(2))
        np.testing.assert_array_equal(reader.read(new), _unit(2))
        np.testing.assert_array_equal(reader.view(new), _unit(2))
        reader.close()
    finally:
        owner.close()


def test_a_populated_reader_of_a_shrunk_slab_raises_units_lost() -> None:
    """A slab shrunk by another process after a reader populated its mapping: the reader's next
    read raises ``UnitsLostError`` naming the unit and the segment (the kernel unmapped the
    pages past the new end; touching them would be a SIGBUS)."""
    owner = SharedMemoryBackend(slab_bytes=4 << 20)
    try:
        key = UnitKey("t3", "tokens")
        for i in range(4):
            owner.put(UnitKey(f"t{i}", "tokens"), _unit(i))
        reader = pickle.loads(pickle.dumps(owner))
        out = _outs(1)[0]
        reader.read_many([UnitRead(UnitKey("t0", "tokens"))], [out])
        os.truncate(owner.paths[0], 1 << 20)  # any process of this user may do this
        with pytest.raises(UnitsLostError, match="truncated") as caught:
            reader.read_many([UnitRead(key)], [out])
        assert [str(k) for k in caught.value.keys] == [str(key)]
        assert owner.paths[0] in str(caught.value)
        reader.close()
    finally:
        owner.close()


def test_a_publisher_maps_its_ring_slots_writable_at_start() -> None:
    """A producer's first write into each ring slot takes no page faults: ``Publisher.start``
    maps the slots writable once (the bytes unchanged), so a fresh reorganizer's first
    micro-batches cost what later ones do (the old path faulted on every 4 KiB page: 512 here)."""
    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 20, num_consumers=1)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    try:
        slots = np.frombuffer(owner.slot(0, 2 << 20), np.uint8)
        slots[::4096] = 5  # the owner's bytes; the producer's populate keeps them
        publisher.start()
        assert (slots[::4096] == 5).all()
        before = _faults()
        np.frombuffer(publisher.ring.slot(0, 2 << 20), np.uint8)[:] = 1
        faults = _faults() - before
        assert faults <= 4, f"{faults} page faults writing two fresh slots"
    finally:
        publisher.close()
        owner.close()
        owner.unlink()


def test_a_fresh_reorganizer_takes_no_page_faults_per_micro_batch() -> None:
    """A reorganizer over a fresh reader of a shared-memory store (a new process's copy) takes
    no page faults for its micro-batches after its first, though every unit is new to it (each
    mini-batch its own trajectories, as a job's new rollouts are), and its TP consumers get
    bit-identical micro-batches holding every token of the plan exactly once."""
    rng = np.random.default_rng(3)
    metas = make_metas(rng.integers(40000, 60000, size=16).tolist())
    owner = SharedMemoryBackend(slab_bytes=32 << 20)
    spec = RingSpec.new(num_slots=2, slot_bytes=2 << 20, num_consumers=2)
    ring = SlotRing.create(spec)
    try:
        fill_backend(owner, metas)
        reader = pickle.loads(pickle.dumps(owner))
        halves = (metas[:8], metas[8:])
        plans = [plan_for(h, Topology(1, 1, 2), 1 << 16, f"mb{i}") for i, h in enumerate(halves)]
        publisher = Publisher(SlotRing.attach(spec))
        publisher.start()
        reorganizer = Reorganizer(reader, publisher)
        counts = [len(p.consumers[0].micro_batches) for p in plans]
        seen: list[list[tuple[bytes, np.ndarray]]] = [[], []]

        def consume(index: int) -> None:
            with MicroBatchConsumer(spec, index) as consumer:
                for lease in consumer.take(sum(counts)):
                    with lease:
                        seen[index].append((bytes(lease.buffer), real_tokens(lease.fields)))

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        reorganizer.deliver("mb0", plans[0].consumers[0])  # its first reads map the slab
        before = _faults()
        reorganizer.deliver("mb1", plans[1].consumers[0])  # units it never read
        faults = _faults() - before
        publisher.finish()
        for thread in threads:
            thread.join(30)
        publisher.close()
        reader.close()
        assert faults <= 2 * counts[1], f"{faults} page faults over {counts[1]} micro-batches"
        assert [b for b, _ in seen[0]] == [b for b, _ in seen[1]]
        tokens = np.sort(np.concatenate([t for _, t in seen[0]]))
        want = np.sort(
            np.concatenate([(i << 20) + np.arange(m.num_tokens) for i, m in enumerate(metas)])
        )
        np.testing.assert_array_equal(tokens, want)
    finally:
        ring.close()
        ring.unlink()
        owner.close()
