"""The unit journal: data-only records, readers replay exactly the complete ones, compaction is followed."""

import json
import os
import struct
from pathlib import Path

import pytest

from knitkit.storage.backends.journal import RESET, UnitJournal


def test_readers_replay_new_complete_records_only(tmp_path: Path) -> None:
    """A record still being written is left for the next look; nothing is replayed twice."""
    stem = str(tmp_path / "journal")
    writer = UnitJournal(stem, owner=True)
    writer.append(("put", "a", 1))
    reader = UnitJournal(stem, owner=False)
    assert list(reader.new_records()) == [("put", "a", 1)]
    assert list(reader.new_records()) == []
    payload = json.dumps(["delete", "a"]).encode()
    with open(writer.path, "ab") as f:  # a writer caught half-way through one record
        f.write(struct.pack("<I", len(payload)) + payload[:3])
    assert list(reader.new_records()) == []
    with open(writer.path, "ab") as f:
        f.write(payload[3:])
    writer.append(("slab", "x", 4096))
    assert list(reader.new_records()) == [("delete", "a"), ("slab", "x", 4096)]
    late = UnitJournal(stem, owner=False, offset=writer.size)
    assert list(late.new_records()) == []
    for journal in (writer, reader, late):
        journal.close()
    assert os.path.exists(f"{stem}-0")  # only the backend that owns the journal unlinks it


def test_records_are_data_not_code(tmp_path: Path) -> None:
    """A pickle appended by another process is rejected as a corrupt record, never executed."""
    stem = str(tmp_path / "journal")
    writer = UnitJournal(stem, owner=True)
    reader = UnitJournal(stem, owner=False)
    marker = tmp_path / "pwned"
    blob = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."  # pickle: os.system(...)
    with open(writer.path, "ab") as f:
        f.write(struct.pack("<I", len(blob)) + blob)
    with pytest.raises(ValueError, match="corrupt record"):
        list(reader.new_records())
    assert not marker.exists()
    writer.close()
    reader.close()


def test_compaction_is_followed_across_generations(tmp_path: Path) -> None:
    """After rewrite() the old generation is gone, the new one holds RESET + the snapshot, and a
    reader (mid-way, or attached to a vanished generation) continues without missing a record."""
    stem = str(tmp_path / "journal")
    writer = UnitJournal(stem, owner=True)
    reader = UnitJournal(stem, owner=False)
    for i in range(50):
        writer.append(("put", f"t{i}", i))
    stale = UnitJournal(stem, owner=False, generation=0, offset=writer.size)
    old_size = writer.size
    writer.rewrite([("put", "t49", 49)])
    assert not os.path.exists(f"{stem}-0") and writer.generation == 1
    assert writer.size < old_size / 10
    writer.append(("delete", "t49"))
    records = list(reader.new_records())
    assert records[:50] == [("put", f"t{i}", i) for i in range(50)]
    assert records[50:] == [(RESET,), ("put", "t49", 49), ("delete", "t49")]
    assert list(stale.new_records()) == [(RESET,), ("put", "t49", 49), ("delete", "t49")]
    writer.rewrite([])
    writer.rewrite([("put", "z", 0)])  # generation 2 is gone before the reader looks
    assert list(reader.new_records())[-2:] == [(RESET,), ("put", "z", 0)]
    late = UnitJournal(stem, owner=False, generation=1, offset=0)  # attach to a vanished one
    assert list(late.new_records()) == [(RESET,), ("put", "z", 0)]
    writer.unlink()
    assert not os.listdir(tmp_path)
    for journal in (writer, reader, stale, late):
        journal.close()


def test_journal_names_are_checked(tmp_path: Path) -> None:
    """A journal stem whose name is not one file name (path traversal) is refused."""
    with pytest.raises(ValueError, match="segment name"):
        UnitJournal(str(tmp_path / ".."), owner=True)
