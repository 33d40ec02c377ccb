"""The unit journal: readers replay exactly the complete records appended since they last looked."""

import os
import pickle
import struct
from pathlib import Path

from knitkit.storage.backends.journal import UnitJournal


def test_readers_replay_new_complete_records_only(tmp_path: Path) -> None:
    """A record still being written is left for the next look; nothing is replayed twice."""
    path = str(tmp_path / "journal")
    writer = UnitJournal(path, owner=True)
    writer.append(("put", "a", 1))
    reader = UnitJournal(path, owner=False)
    assert list(reader.new_records()) == [("put", "a", 1)]
    assert list(reader.new_records()) == []
    payload = pickle.dumps(("delete", "a"))
    with open(path, "ab") as f:  # a writer caught half-way through one record
        f.write(struct.pack("<I", len(payload)) + payload[:3])
    assert list(reader.new_records()) == []
    with open(path, "ab") as f:
        f.write(payload[3:])
    writer.append(("slab", "/dev/shm/x", 4096))
    assert list(reader.new_records()) == [("delete", "a"), ("slab", "/dev/shm/x", 4096)]
    late = UnitJournal(path, owner=False, offset=writer.size)
    assert list(late.new_records()) == []
    for journal in (writer, reader, late):
        journal.close()
    assert os.path.exists(path)  # only the backend that owns the journal unlinks it
