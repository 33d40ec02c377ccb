"""The safetensors disk backend: standard shards, byte-range preadv reads, in-place replace."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from knitkit.storage import SafetensorsBackend
from knitkit.types import UnitKey, UnitRead


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
    calls = _record_preadv(monkeypatch)
    out = np.empty((60, 48, 8), dtype=np.uint8)
    backend.read(key, [(10, 40), (250, 280)], out=out)
    row = 48 * 8
    assert [n for _, n in calls] == [30 * row, 30 * row]
    assert calls[1][0] - calls[0][0] == 240 * row
    np.testing.assert_array_equal(out, np.concatenate([units[key][10:40], units[key][250:280]]))
    backend.close()


def test_column_reads_preadv_each_token_range_once_or_each_row_past_long_gaps(
    tmp_path: Path, monkeypatch
) -> None:
    """A stage's layers of routing rows (small gaps) take one ``preadv`` per 1 MiB of rows, from
    the range's first wanted byte to its last (NOTE [ Batched disk reads ]); columns whose rows'
    other columns are long (past ``_GAP_SKIP``) are read row by row, gaps unread."""
    backend = SafetensorsBackend(str(tmp_path), shard_bytes=1 << 30)
    routing = np.random.default_rng(0).integers(0, 64, (4096, 48, 8), dtype=np.uint8)
    wide = np.random.default_rng(1).integers(0, 64, (4, 100, 1024), dtype=np.uint8)
    backend.put(UnitKey("t", "routing"), routing)
    backend.put(UnitKey("t", "wide"), wide)
    backend.flush()
    calls = _record_preadv(monkeypatch)
    stage, rows = np.empty((3990, 24, 8), np.uint8), np.empty((3, 1, 1024), np.uint8)
    reads = [UnitRead(UnitKey("t", "routing"), ((10, 4000),), (24, 48))]
    backend.read_many(
        [*reads, UnitRead(UnitKey("t", "wide"), ((0, 2), (3, 4)), (3, 4))], [stage, rows]
    )
    np.testing.assert_array_equal(stage, routing[10:4000, 24:48])
    np.testing.assert_array_equal(rows, wide[[0, 1, 3], 3:4])
    row, staged = 48 * 8, (1 << 20) // (48 * 8)  # rows per staged preadv
    wide_calls = [c for c in calls if c[1] == 1024]
    assert [n for _, n in calls if n != 1024] == [staged * row - 192, (3990 - staged) * row - 192]
    assert [b - a for (a, _), (b, _) in itertools.pairwise(wide_calls)] == [100 << 10, 200 << 10]
    assert backend.bytes_read == stage.nbytes + rows.nbytes
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


@pytest.mark.parametrize("neighbour", [True, False], ids=["shard-kept", "shard-removed"])
def test_a_reader_reads_a_unit_written_again_under_its_key(tmp_path: Path, neighbour: bool) -> None:
    """Readers made before a unit is deleted and put again under the same key (one that read it
    before, one that did not) read the new bytes: never the old ones from a shard that still
    holds a live neighbour (issue 30.7: a trajectory re-written as 900..907 was delivered as
    100..107), never ``FileNotFoundError`` for a shard removed with its last unit (NOTE [ Disk
    readers follow the owner ]); also after the journal was compacted (every delete of the
    last live unit compacts it)."""
    backend = SafetensorsBackend(str(tmp_path), shard_bytes=1 << 20)
    key = UnitKey("t0", "tokens")
    backend.put(key, np.arange(100, 108, dtype=np.int64))
    if neighbour:
        backend.put(UnitKey("t1", "tokens"), np.arange(8, dtype=np.int64))
    backend.flush()
    used, unused = (pickle.loads(pickle.dumps(backend)) for _ in range(2))
    np.testing.assert_array_equal(used.read(key), np.arange(100, 108))
    for again in range(3):
        backend.delete(key)
        backend.put(key, np.arange(900, 908, dtype=np.int64) + again)
        backend.flush()
        for reader in (used, unused):
            np.testing.assert_array_equal(reader.read(key, [(2, 4)]), [902 + again, 903 + again])
    assert len(list(tmp_path.glob("*.safetensors"))) == (2 if neighbour else 1)
    for each in (used, unused, backend):
        each.close()


def test_the_journal_follows_the_live_units_not_the_run(tmp_path: Path) -> None:
    """800 delete + put cycles of one unit beside a live one: the owner's journal stays bounded
    (compacted once dead records outweigh the live ones, 64 KiB at least) and a reader made at
    the start follows it across compactions to the newest bytes."""
    backend = SafetensorsBackend(str(tmp_path), shard_bytes=1 << 20)
    backend.put(UnitKey("live", "tokens"), np.arange(4, dtype=np.int32))
    key = UnitKey("t", "tokens")
    backend.put(key, np.zeros(4, dtype=np.int32))
    backend.flush()
    reader = pickle.loads(pickle.dumps(backend))
    for i in range(1, 801):
        backend.delete(key)
        backend.put(key, np.full(4, i, dtype=np.int32))
        backend.flush()
        if i % 200 == 0:
            assert int(reader.read(key)[0]) == i
    assert backend.journal_bytes < 3 * (64 << 10), backend.journal_bytes
    np.testing.assert_array_equal(reader.read(UnitKey("live", "tokens")), np.arange(4))
    reader.close()
    backend.close()


def test_sync_fsyncs_what_changed_since_the_last_sync_and_flush_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ Durable shards ]: ``flush`` (what every served pass does) fsyncs nothing; ``sync``
    fsyncs each shard written or changed in place since the last sync, then the directory;
    a sync with nothing new fsyncs nothing. Observed through ``os.fsync``."""
    synced: list[str] = []
    fsync = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    directory = (tmp_path / "shards").resolve()
    backend = SafetensorsBackend(str(directory), shard_bytes=1 << 20)
    shards = []
    for i in range(2):
        backend.put(UnitKey(f"t{i}", "tokens"), np.arange(4, dtype=np.int32))
        backend.flush()
        shards += [str(p) for p in directory.glob("shard-*") if str(p) not in shards]
    first = shards[0]
    assert synced == []
    backend.sync()
    assert set(synced) == {*shards, str(directory), str(directory.parent)}
    synced.clear()
    backend.sync()
    assert synced == []
    backend.write_ranges(UnitKey("t0", "tokens"), [(1, 2)], np.array([7], dtype=np.int32))
    backend.sync()
    assert synced == [first]
    backend.close()


def _forked_reader(backend: SafetensorsBackend, key: UnitKey, conn: Connection) -> None:
    conn.recv()  # the owner wrote the unit again
    try:
        backend.put(UnitKey("child", "tokens"), np.zeros(1, dtype=np.int64))
        refused = False
    except RuntimeError:
        refused = True
    conn.send((backend.read(key).tolist(), refused))


def test_a_forked_child_of_the_owner_reads_as_a_reader(tmp_path: Path) -> None:
    """A forked child of the owner (a DataLoader worker) follows the owner's journal like a
    pickled reader: it reads a unit deleted and written again after the fork at its new place,
    and refuses to write (NOTE [ Disk readers follow the owner ])."""
    backend = SafetensorsBackend(str(tmp_path), shard_bytes=1 << 20)
    key = UnitKey("t0", "tokens")
    backend.put(key, np.arange(100, 108, dtype=np.int64))
    backend.put(UnitKey("t1", "tokens"), np.arange(8, dtype=np.int64))
    backend.flush()
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    child = context.Process(target=_forked_reader, args=(backend, key, theirs))
    child.start()
    backend.delete(key)
    backend.put(key, np.arange(900, 908, dtype=np.int64))
    backend.flush()
    ours.send(None)
    assert ours.poll(60), "the forked child never answered"
    assert ours.recv() == (list(range(900, 908)), True)
    child.join(60)
    assert child.exitcode == 0
    backend.put(UnitKey("t2", "tokens"), np.arange(3, dtype=np.int64))  # still the owner
    backend.close()


def _record_preadv(monkeypatch) -> list[tuple[int, int]]:
    """Record every ``os.preadv`` call as (file offset, bytes asked) while still reading."""
    calls: list[tuple[int, int]] = []
    real_preadv = os.preadv

    def recording_preadv(fd: int, buffers: list, offset: int) -> int:
        calls.append((offset, sum(memoryview(b).nbytes for b in buffers)))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording_preadv)
    return calls
