"""The disk backend over a long run: bounded file descriptors, corrupt shards, owner-only files
(issue 9, classes 4, 9 and R6)."""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from knitkit.storage.backends.disk import SafetensorsBackend
from knitkit.storage.backends.shard_header import CorruptShardError
from knitkit.types import UnitKey


def _open_shards(directory: Path) -> int:
    """Descriptors of this process open on shard files in ``directory``, deleted ones included:
    the backend's, never another thread's (a session's Ray runtime opens files of its own)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        count += target.startswith(f"{directory.resolve()}/") and ".safetensors" in target
    return count


def test_open_files_stay_bounded_and_deleted_shards_are_closed(tmp_path: Path) -> None:
    """Reading 40 shards with ``max_open_shards=4`` never holds more than 4 shard files open
    (in the writer and in a pickled reader); deleting every unit closes them all."""
    backend = SafetensorsBackend(str(tmp_path / "shards"), shard_bytes=1 << 20, max_open_shards=4)
    keys = [UnitKey(f"t{i}", "tokens") for i in range(40)]
    for i, key in enumerate(keys):
        backend.put(key, np.full(8, i, dtype=np.int32))
        backend.flush()  # one shard per unit
    reader = pickle.loads(pickle.dumps(backend))
    baseline = _open_shards(tmp_path / "shards")
    for _ in range(3):
        for i, key in enumerate(keys):
            assert int(backend.read(key, [(2, 4)])[0]) == i
            assert int(reader.read(key)[0]) == i
            assert backend.open_files <= 4 and reader.open_files <= 4
    assert _open_shards(tmp_path / "shards") - baseline <= 8
    reader.close()
    for key in keys:
        backend.delete(key)
    assert backend.open_files == 0
    assert list((tmp_path / "shards").glob("*.safetensors")) == []
    backend.close()
    assert os.listdir(tmp_path / "shards") == []  # the journal and its lock went with the owner


def _shard_bytes(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    "corrupt",
    [
        b"\x01\x02",  # shorter than the header length
        struct.pack("<Q", 1 << 40) + b"{}",  # header length past the end (MemoryError before)
        struct.pack("<Q", 4) + b"\xff\xfe{}",  # not JSON
        _shard_bytes({"tx/tokens": {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]}}, b"")[
            :-1
        ],
    ],
)
def test_a_corrupt_shard_fails_only_its_own_units(tmp_path: Path, corrupt: bytes) -> None:
    """A garbage or truncated ``*.safetensors`` file in the directory does not stop reads of good
    shards (in the writer or in a reader that scans the directory); asking for a unit it may
    hold names the file."""
    directory = tmp_path / "shards"
    backend = SafetensorsBackend(str(directory), shard_bytes=1 << 20)
    backend.put(UnitKey("t0", "tokens"), np.arange(6, dtype=np.int32))
    reader = pickle.loads(pickle.dumps(backend))  # made before the later shards exist
    bad = directory / "shard-000000000bad.safetensors"
    bad.write_bytes(corrupt)
    backend.put(UnitKey("t1", "tokens"), np.arange(3, dtype=np.int32))
    backend.flush()
    for each in (backend, reader):
        np.testing.assert_array_equal(each.read(UnitKey("t1", "tokens")), [0, 1, 2])
        np.testing.assert_array_equal(each.read(UnitKey("t0", "tokens"), [(4, 6)]), [4, 5])
        with pytest.raises(KeyError, match=str(bad)):
            each.read(UnitKey("tx", "tokens"))
    fresh = SafetensorsBackend(str(directory))
    np.testing.assert_array_equal(fresh.read(UnitKey("t1", "tokens")), [0, 1, 2])
    for each in (backend, reader, fresh):
        each.close()


def test_header_offsets_must_match_dtype_and_shape(tmp_path: Path) -> None:
    """An entry whose offsets disagree with dtype x shape, or lie past the end of a truncated file,
    fails with ``CorruptShardError`` naming the file; the other units of that shard read fine
    (never bytes silently taken from a neighbour)."""
    directory = tmp_path / "shards"
    directory.mkdir()
    header = {
        "good/tokens": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]},
        "wide/tokens": {"dtype": "I32", "shape": [4], "data_offsets": [8, 16]},  # needs 16
        "past/tokens": {"dtype": "I32", "shape": [2], "data_offsets": [16, 24]},
    }
    path = directory / "shard-00000000mixd.safetensors"
    path.write_bytes(_shard_bytes(header, np.arange(4, dtype=np.int32).tobytes()))
    backend = SafetensorsBackend(str(directory))
    np.testing.assert_array_equal(backend.read(UnitKey("good", "tokens")), [0, 1])
    for owner in ("wide", "past"):
        with pytest.raises(CorruptShardError, match=str(path)):
            backend.read(UnitKey(owner, "tokens"))
    backend.close()


def test_shards_are_owner_only_and_never_seen_half_written(tmp_path: Path) -> None:
    """The shard directory is 0700 and shards 0600; a shard appears under its final name only
    once complete (no temporary file is left)."""
    directory = tmp_path / "shards"
    backend = SafetensorsBackend(str(directory), shard_bytes=1 << 20)
    backend.put(UnitKey("t0", "tokens"), np.arange(6, dtype=np.int32))
    backend.flush()
    assert os.stat(directory).st_mode & 0o777 == 0o700
    (shard,) = (p.name for p in directory.glob("shard-*"))
    assert shard.startswith("shard-") and shard.endswith(".safetensors")
    assert os.stat(directory / shard).st_mode & 0o777 == 0o600
    backend.close()
