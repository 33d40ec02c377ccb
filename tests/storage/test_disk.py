"""The safetensors disk backend: standard shards, byte-range preadv reads, in-place replace."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from knitkit.storage import SafetensorsBackend
from knitkit.types import UnitKey


def _filled(tmp_path: Path) -> tuple[SafetensorsBackend, dict[UnitKey, np.ndarray]]:
    backend = SafetensorsBackend(str(tmp_path), shard_bytes=1 << 30)
    rng = np.random.default_rng(0)
    units = {
        UnitKey(f"t{i}", "routing"): rng.integers(0, 64, (300, 48, 8), dtype=np.uint8)
        for i in range(4)
    }
    units[UnitKey("t0", "reward")] = np.array(1.5, dtype=np.float32)
    for key, array in units.items():
        backend.put(key, array)
    backend.flush()
    return backend, units


def test_shards_are_plain_safetensors(tmp_path: Path) -> None:
    """safetensors itself loads every unit of a shard, named 'owner/field'."""
    backend, units = _filled(tmp_path)
    (shard,) = list(tmp_path.glob("*.safetensors"))
    loaded = load_file(str(shard))
    assert set(loaded) == {str(k) for k in units}
    for key, array in units.items():
        np.testing.assert_array_equal(loaded[str(key)], array)
    backend.close()


def test_range_reads_preadv_only_the_ranges_into_the_destination(
    tmp_path: Path, monkeypatch
) -> None:
    """Two CP chunks of one unit: two preadv calls of exactly those rows, into the caller's buffer."""
    backend, units = _filled(tmp_path)
    key = UnitKey("t2", "routing")
    calls: list[tuple[int, int]] = []
    real_preadv = os.preadv

    def recording_preadv(fd: int, buffers: list, offset: int) -> int:
        calls.append((offset, sum(memoryview(b).nbytes for b in buffers)))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording_preadv)
    out = np.empty((60, 48, 8), dtype=np.uint8)
    backend.read(key, [(10, 40), (250, 280)], out=out)
    row = 48 * 8
    assert [n for _, n in calls] == [30 * row, 30 * row]
    assert calls[1][0] - calls[0][0] == 240 * row
    np.testing.assert_array_equal(out, np.concatenate([units[key][10:40], units[key][250:280]]))
    backend.close()


def test_replace_rewrites_the_bytes_in_place(tmp_path: Path) -> None:
    """replace() changes the shard file itself, and only that unit."""
    backend, units = _filled(tmp_path)
    key = UnitKey("t1", "routing")
    new = np.full_like(units[key], 7)
    backend.replace(key, new)
    (shard,) = list(tmp_path.glob("*.safetensors"))
    loaded = load_file(str(shard))
    np.testing.assert_array_equal(loaded[str(key)], new)
    np.testing.assert_array_equal(loaded["t0/routing"], units[UnitKey("t0", "routing")])
    backend.close()


def test_a_pickled_backend_reads_the_same_shards(tmp_path: Path) -> None:
    """Pickling flushes and hands over the parsed headers; the copy reads ranges from the files."""
    backend, units = _filled(tmp_path)
    backend.put(UnitKey("late", "tokens"), np.arange(10, dtype=np.int64))
    reader = pickle.loads(pickle.dumps(backend))
    np.testing.assert_array_equal(reader.read(UnitKey("late", "tokens"), [(3, 5)]), [3, 4])
    np.testing.assert_array_equal(
        reader.read(UnitKey("t3", "routing"), [(0, 1)]), units[UnitKey("t3", "routing")][:1]
    )
    reader.close()
    backend.close()


def test_a_reader_indexes_shards_flushed_after_it_was_made(tmp_path: Path) -> None:
    """A reader made before a later flush finds the new shard's units on first use; a unit still
    buffered in the writer is an error that says to flush."""
    backend, _ = _filled(tmp_path)
    reader = pickle.loads(pickle.dumps(backend))
    backend.put(UnitKey("later", "tokens"), np.arange(6, dtype=np.int32))
    with pytest.raises(KeyError, match=r"later/tokens.*flush"):
        reader.read(UnitKey("later", "tokens"))
    backend.flush()
    np.testing.assert_array_equal(reader.read(UnitKey("later", "tokens"), [(4, 6)]), [4, 5])
    reader.close()
    backend.close()


def test_a_shard_goes_when_its_last_unit_is_deleted(tmp_path: Path) -> None:
    """Deleting every unit of a shard removes the file; other shards stay."""
    backend, units = _filled(tmp_path)
    backend.put(UnitKey("other", "tokens"), np.arange(4))
    backend.flush()
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    for key in units:
        backend.delete(key)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    with pytest.raises(KeyError, match="t0/routing"):
        backend.read(UnitKey("t0", "routing"))
    backend.close()
