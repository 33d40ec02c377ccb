"""A disk backend used from several threads of its owner (a job's driver: rollout writes and
write-backs on some, the scheduler's flush on another) loses no unit: a ``put`` while a flush
writes its shard waits for that flush and lands in the next one (NOTE [ Owner threads ] in
knitkit/storage/backends/disk.py). Before, the flush cleared a buffer it had not written: the
unit was gone from the backend while the store's index kept it, and the job's readers and
clean-up raised ``KeyError: unknown unit`` (tests/job/test_checkpoint.py, ~1 run in 10 loaded)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from knitkit.storage.backends import disk
from knitkit.storage.backends.disk import SafetensorsBackend
from knitkit.types import UnitKey

WINDOW_S = 1.0
"""How long the flush holds its shard write open for a racing put: the race window, not a wait
for an event that must come (with the lock the put cannot finish inside it)."""
WAIT_S = 60.0
"""Bound of every wait on another thread: generous, for a loaded machine."""


def test_a_put_while_a_flush_writes_is_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = SafetensorsBackend(str(tmp_path / "units"))
    first, second = UnitKey("t0", "tokens"), UnitKey("t1", "old_lp")
    backend.put(first, np.arange(4, dtype=np.int32))
    writing, put_done = threading.Event(), threading.Event()
    save_file = disk.save_file

    def held_save(tensors: dict[str, np.ndarray], path: str) -> None:
        writing.set()
        put_done.wait(WINDOW_S)  # a racing put finishes in here unless it waits for the flush
        save_file(tensors, path)

    def put() -> None:
        backend.put(second, np.arange(3, dtype=np.float32))
        put_done.set()

    monkeypatch.setattr(disk, "save_file", held_save)
    flusher = threading.Thread(target=backend.flush)
    flusher.start()
    assert writing.wait(WAIT_S), "the flush never wrote its shard"
    putter = threading.Thread(target=put)
    putter.start()
    flusher.join(WAIT_S)
    putter.join(WAIT_S)
    assert not flusher.is_alive() and not putter.is_alive()
    backend.flush()
    try:
        assert set(backend.keys()) == {first, second}
        np.testing.assert_array_equal(backend.read(second), np.arange(3, dtype=np.float32))
        backend.delete(second)  # the job's clean-up of the unit
    finally:
        backend.close()
