"""The batched read seam ``UnitBackend.read_many``, run against every registered backend."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from knitkit.storage.backends.backend import UnitBackend
from knitkit.types import UnitKey, UnitRead


def _units(backend: UnitBackend) -> dict[UnitKey, np.ndarray]:
    rng = np.random.default_rng(7)
    units = {
        UnitKey("a", "routing"): rng.integers(0, 64, (37, 4, 2), dtype=np.uint8),
        UnitKey("b", "routing"): rng.integers(0, 64, (20, 4, 2), dtype=np.uint8),
        UnitKey("a", "logprobs"): rng.standard_normal(37).astype(np.float32),
        UnitKey("a", "reward"): np.array(1.5, dtype=np.float32),
    }
    for key, array in units.items():
        backend.put(key, array)
    return units


def test_read_many_equals_one_read_per_unit(backend: UnitBackend) -> None:
    """read_many(reads, outs) fills every out exactly as read(key, ranges, out=) would (ranges in
    order, empty and whole-unit reads included, several reads of one unit), in ONE call into views
    of a single buffer, and bytes_read grows by exactly the bytes delivered."""
    units = _units(backend)
    reads = [
        UnitRead(UnitKey("a", "routing"), ((0, 5), (30, 37))),
        UnitRead(UnitKey("b", "routing"), None),
        UnitRead(UnitKey("a", "logprobs"), ((10, 12), (12, 20))),
        UnitRead(UnitKey("a", "routing"), ((3, 3),)),
        UnitRead(UnitKey("a", "reward"), None),
        UnitRead(UnitKey("a", "routing"), ((36, 37), (0, 1))),
    ]
    wants = []
    for read in reads:
        unit = units[read.key]
        wants.append(
            unit if read.ranges is None else np.concatenate([unit[a:b] for a, b in read.ranges])
        )
    slot = np.full(sum(w.nbytes for w in wants) + 64 * len(wants), 0xAB, dtype=np.uint8)
    outs, at = [], 0
    for want in wants:
        outs.append(slot[at : at + want.nbytes].view(want.dtype).reshape(want.shape))
        at += (want.nbytes + 63) // 64 * 64
    before = backend.bytes_read
    backend.read_many(reads, outs)
    for read, want, out in zip(reads, wants, outs, strict=True):
        np.testing.assert_array_equal(out, want, err_msg=str(read))
    assert backend.bytes_read - before == sum(w.nbytes for w in wants)


def test_read_many_keeps_reads_errors(backend: UnitBackend) -> None:
    """read_many raises like read: KeyError naming an unknown key, IndexError naming a unit read
    out of range, ValueError for a mismatched out or for unpaired reads and outs."""
    _units(backend)
    key = UnitKey("a", "routing")
    good = np.empty((5, 4, 2), dtype=np.uint8)
    with pytest.raises(KeyError, match="missing"):
        backend.read_many([UnitRead(UnitKey("missing", "routing"))], [good])
    with pytest.raises(IndexError, match="a/routing"):
        backend.read_many([UnitRead(key, ((30, 40),))], [np.empty((10, 4, 2), np.uint8)])
    with pytest.raises(ValueError, match="a/routing"):
        backend.read_many([UnitRead(key, ((0, 5),))], [np.empty((5, 4, 2), np.int32)])
    with pytest.raises(ValueError, match="pair"):
        backend.read_many([UnitRead(key, ((0, 5),))], [good, good])


def test_disk_read_many_over_many_shards_and_runs(tmp_path) -> None:
    """A disk read_many whose pieces span several shards, more file-contiguous pieces than one
    preadv may take (IOV_MAX), and interleaved shards, fills every out exactly as read does, and
    a shard truncated after it was indexed fails with CorruptShardError naming that shard."""
    from knitkit.storage.backends.disk import SafetensorsBackend
    from knitkit.storage.backends.shard_header import CorruptShardError

    backend = SafetensorsBackend(str(tmp_path / "shards"), shard_bytes=4 << 10)
    rng = np.random.default_rng(3)
    units = {
        UnitKey(f"t{i}", "tokens"): rng.integers(0, 1 << 20, 300, dtype=np.int32) for i in range(12)
    }
    for key, array in units.items():
        backend.put(key, array)
    backend.flush()
    keys = list(units)
    reads = [UnitRead(keys[0], tuple((r, r + 1) for r in range(0, 300, 2))[::-1])]
    reads += [UnitRead(k) for k in keys[::-1]]  # shards interleave, whole units back to back
    reads += [UnitRead(keys[1], tuple((r, r + 1) for r in range(300)))]  # 300 adjacent rows
    long = UnitKey("long", "tokens")
    backend.put(long, rng.integers(0, 1 << 20, 1500, dtype=np.int32))
    reads += [UnitRead(long, tuple((r, r + 1) for r in range(1500)))]  # one run > IOV_MAX pieces
    wants = [backend.read(r.key, r.ranges) for r in reads]
    outs = [np.zeros_like(w) for w in wants]
    backend.read_many(reads, outs)
    for read, want, out in zip(reads, wants, outs, strict=True):
        np.testing.assert_array_equal(out, want, err_msg=str(read.key))
    shard = backend._entry(keys[5]).shard
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 4)
    with pytest.raises(CorruptShardError, match=shard):
        backend.read_many([UnitRead(k) for k in keys], [np.empty(300, np.int32) for _ in keys])
    backend.close()


def test_shm_reader_read_many_sees_units_put_after_pickling() -> None:
    """A pickled shared-memory reader's read_many follows the owner's journal: units put after
    the reader was made are read, and deleted ones raise KeyError naming them."""
    from knitkit.storage.backends.shm import SharedMemoryBackend

    owner = SharedMemoryBackend(slab_bytes=1 << 16)
    try:
        owner.put(UnitKey("early", "tokens"), np.arange(10, dtype=np.int32))
        reader = pickle.loads(pickle.dumps(owner))
        owner.put(UnitKey("late", "tokens"), np.arange(100, 140, dtype=np.int32))
        outs = [np.empty(4, np.int32), np.empty(3, np.int32)]
        reader.read_many(
            [
                UnitRead(UnitKey("early", "tokens"), ((6, 10),)),
                UnitRead(UnitKey("late", "tokens"), ((0, 3),)),
            ],
            outs,
        )
        np.testing.assert_array_equal(outs[0], [6, 7, 8, 9])
        np.testing.assert_array_equal(outs[1], [100, 101, 102])
        owner.delete(UnitKey("early", "tokens"))
        with pytest.raises(KeyError, match="early/tokens"):
            reader.read_many([UnitRead(UnitKey("early", "tokens"))], [np.empty(10, np.int32)])
        reader.close()
    finally:
        owner.close()
