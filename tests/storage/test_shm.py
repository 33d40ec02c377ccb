"""The shared-memory backend: zero-copy readers in other processes, slab reuse, explicit lifetime."""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.connection import Connection

import numpy as np
import pytest

from knitkit.storage import SharedMemoryBackend
from knitkit.types import UnitKey

KEY = UnitKey("t0", "routing")


def _reader(backend: SharedMemoryBackend, conn: Connection) -> None:
    view = backend.view(KEY)
    conn.send((int(view.sum()), view.flags.writeable, view.flags.owndata))
    conn.recv()  # the owner has rewritten the unit in place
    conn.send(int(view.sum()))  # same view, no new read
    conn.send(backend.read(KEY, [(2, 4)]).tolist())


def test_another_process_reads_the_units_without_copies() -> None:
    """A pickled backend in a spawned process maps the same pages: the owner's in-place update shows
    through the reader's existing view; the reader exiting does not unlink anything."""
    backend = SharedMemoryBackend(slab_bytes=1 << 20)
    try:
        backend.put(KEY, np.ones((8, 2), dtype=np.int32))
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_reader, args=(backend, child))
        process.start()
        total, writeable, owndata = parent.recv()
        assert (total, writeable, owndata) == (16, False, False)
        backend.replace(KEY, np.full((8, 2), 3, dtype=np.int32))
        parent.send("go")
        assert parent.recv() == 48
        assert parent.recv() == [[3, 3], [3, 3]]
        process.join(timeout=60)
        assert process.exitcode == 0
        assert all(os.path.exists(p) for p in backend.paths)
        np.testing.assert_array_equal(backend.read(KEY), np.full((8, 2), 3))
    finally:
        backend.close()
    assert backend.paths and not any(os.path.exists(p) for p in backend.paths)


def test_freed_blocks_are_reused_instead_of_new_segments() -> None:
    """put/delete cycles stay inside the first slab; a unit larger than a slab gets its own."""
    backend = SharedMemoryBackend(slab_bytes=1 << 20)
    try:
        for i in range(50):
            key = UnitKey(f"t{i}", "logprobs")
            backend.put(key, np.full(100_000 // 4, i, dtype=np.float32))
            if i >= 3:
                backend.delete(UnitKey(f"t{i - 3}", "logprobs"))
        assert len(backend.paths) == 1 and backend.used_bytes <= 4 * 100_032
        backend.put(UnitKey("big", "routing"), np.zeros((3 << 20,), dtype=np.uint8))
        assert len(backend.paths) == 2
        np.testing.assert_array_equal(backend.read(UnitKey("t49", "logprobs"), [(0, 2)]), [49, 49])
    finally:
        backend.close()


def test_a_reader_cannot_write() -> None:
    """Writes go through the owner; an attached reader refuses put/replace/delete by name."""
    import pickle

    backend = SharedMemoryBackend(slab_bytes=1 << 20)
    try:
        backend.put(KEY, np.zeros(4, dtype=np.int32))
        reader = pickle.loads(pickle.dumps(backend))
        for call in (
            lambda: reader.put(UnitKey("x", "tokens"), np.zeros(1)),
            lambda: reader.replace(KEY, np.zeros(4, dtype=np.int32)),
            lambda: reader.delete(KEY),
        ):
            with pytest.raises(RuntimeError, match="reader"):
                call()
        reader.close()
        assert all(os.path.exists(p) for p in backend.paths)
    finally:
        backend.close()


def _late_reader(backend: SharedMemoryBackend, conn: Connection) -> None:
    conn.recv()  # the owner has put more units, one in a new slab, and deleted KEY
    late = UnitKey("t1", "routing")
    big = UnitKey("t2", "routing")
    conn.send((backend.read(late, [(1, 3)]).tolist(), int(backend.read(big).sum())))
    try:
        backend.read(KEY)
    except KeyError as exc:
        conn.send(str(exc))


def test_a_reader_sees_units_put_after_it_was_made() -> None:
    """A long-lived reader (a reorganizer spawned before the rollout) follows the owner's journal:
    units put later, in the same or a new slab, read correctly; deleted units are gone."""
    backend = SharedMemoryBackend(slab_bytes=4096)
    try:
        backend.put(KEY, np.ones((8, 2), dtype=np.int32))
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_late_reader, args=(backend, child))
        process.start()
        backend.put(UnitKey("t1", "routing"), np.arange(10, dtype=np.int64).reshape(5, 2))
        backend.put(UnitKey("t2", "routing"), np.ones((2048, 2), dtype=np.int32))  # a new slab
        backend.delete(KEY)
        parent.send("go")
        assert parent.recv() == ([[2, 3], [4, 5]], 4096)
        assert "unknown unit t0/routing" in parent.recv()
        process.join(timeout=60)
        assert process.exitcode == 0
        assert len(backend.paths) == 2
    finally:
        backend.close()
