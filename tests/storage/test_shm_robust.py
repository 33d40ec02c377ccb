"""The shared-memory backend under a long run: full /dev/shm, journal growth, dead owners, hostile
names and records (issue 9, classes 2, 5, 6 and R6)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import signal
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from knitkit.cli import main as knitkit_main
from knitkit.storage.backends.segments import check_segment_name, segment_pid
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.backends.slab import Slab
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.types import UnitKey

KEY = UnitKey("t0", "tokens")


def _owned(directory: str, pid: int) -> list[str]:
    return sorted(n for n in os.listdir(directory) if segment_pid(n) == pid)


def test_a_slab_larger_than_dev_shm_is_an_oserror_and_changes_nothing() -> None:
    """A slab that cannot be reserved raises ``OSError`` at allocation naming the segment, its size
    and the free space; the backend is unchanged, no file is left, the next allocation works."""
    stat = os.statvfs("/dev/shm")
    too_big = stat.f_blocks * stat.f_frsize + (1 << 30)
    backend = SharedMemoryBackend(slab_bytes=too_big)
    try:
        with pytest.raises(OSError, match=rf"{too_big} bytes .*knitkit-{os.getpid()}-.*bytes free"):
            backend.put(KEY, np.arange(8, dtype=np.int32))
        assert list(backend.keys()) == [] and backend.paths == ()
        assert [
            n for n in _owned("/dev/shm", os.getpid()) if "slab" in n and backend._prefix in n
        ] == []
        backend.slab_bytes = 1 << 16
        backend.put(KEY, np.arange(8, dtype=np.int32))
        np.testing.assert_array_equal(backend.read(KEY), np.arange(8))
    finally:
        backend.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[str]:
    """A 4 MiB tmpfs: a /dev/shm that really fills up."""
    mount = tmp_path / "shm"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(directory: str, conn) -> None:
    backend = SharedMemoryBackend(slab_bytes=1 << 20, directory=directory)
    stored = 0
    try:
        for i in range(64):
            backend.put(UnitKey(f"t{i}", "tokens"), np.ones(1 << 20, dtype=np.uint8))
            stored += 1
    except OSError as exc:
        conn.send((stored, str(exc), sorted(map(str, backend.keys()))))
    backend.close()


def test_a_full_tmpfs_raises_instead_of_sigbus(small_tmpfs: str) -> None:
    """Filling a 4 MiB tmpfs with 1 MiB units: the put that does not fit raises ``OSError``
    naming the segment (the process is not killed by SIGBUS); earlier units stay readable."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_fill, args=(small_tmpfs, child))
    process.start()
    process.join(120)
    assert process.exitcode == 0, f"writer died with exit code {process.exitcode} (-7 is SIGBUS)"
    stored, message, keys = parent.recv()
    assert 1 <= stored < 4 and len(keys) == stored
    assert "cannot reserve" in message and small_tmpfs in message and "bytes free" in message
    assert os.listdir(small_tmpfs) == []


def test_the_journal_follows_what_is_live() -> None:
    """1,000 put+delete pairs leave a journal of a few KiB (compaction), and a reader made before
    them still follows: it sees the last unit and not the deleted ones."""
    backend = SharedMemoryBackend(slab_bytes=1 << 20)
    try:
        backend.put(KEY, np.arange(4, dtype=np.int32))
        reader = pickle.loads(pickle.dumps(backend))
        empty = backend.journal_bytes
        for i in range(1000):
            key = UnitKey(f"t{i + 1}", "tokens")
            backend.put(key, np.full(16, i, dtype=np.int32))
            backend.delete(key)
            if i == 500:
                np.testing.assert_array_equal(reader.read(KEY), np.arange(4))
        backend.put(UnitKey("last", "tokens"), np.full(3, 7, dtype=np.int32))
        assert backend.journal_bytes < empty + 8 * 1024
        np.testing.assert_array_equal(reader.read(UnitKey("last", "tokens")), [7, 7, 7])
        with pytest.raises(KeyError, match="t1000/tokens"):
            reader.read(UnitKey("t1000", "tokens"))
        backend.delete(KEY)
        backend.delete(UnitKey("last", "tokens"))
        late = pickle.loads(pickle.dumps(backend))
        assert list(late.keys()) == []
        reader.close()
        late.close()
    finally:
        backend.close()
    assert _owned("/dev/shm", os.getpid()) == [] or all(
        backend._prefix not in n for n in _owned("/dev/shm", os.getpid())
    )


def _owner_then_sigkill(directory: str) -> None:
    backend = SharedMemoryBackend(slab_bytes=1 << 16, directory=directory, sweep=False)
    backend.put(KEY, np.arange(8, dtype=np.int32))
    os.kill(os.getpid(), signal.SIGKILL)


def _killed_owner(directory: str) -> int:
    process = mp.get_context("spawn").Process(target=_owner_then_sigkill, args=(directory,))
    process.start()
    process.join(120)
    assert process.exitcode == -signal.SIGKILL
    assert process.pid is not None
    assert len(_owned(directory, process.pid)) == 3  # its slab, journal and lock stay behind
    return process.pid


def test_segments_of_a_sigkilled_owner_are_reclaimed(tmp_path: Path) -> None:
    """A SIGKILLed owner leaves its slab, journal and lock file; the next backend's start-up sweep
    removes them, and a slot ring nobody holds the owner's lock of (issue 30.11); ``knitkit
    shm-clean`` removes both by hand; live owners' segments are kept."""
    directory = str(tmp_path)
    live = SharedMemoryBackend(slab_bytes=1 << 16, directory=directory)
    live.put(KEY, np.arange(8, dtype=np.int32))
    try:
        dead = _killed_owner(directory)
        ring = os.path.join(directory, f"knitkit_{dead}_deadbeef")  # a ring named by that pid
        open(ring, "wb").close()
        fresh = SharedMemoryBackend(directory=directory)
        assert _owned(directory, dead) == []
        fresh.close()
        dead = _killed_owner(directory)
        ring = os.path.join(directory, f"knitkit_{dead}_deadbeef")
        open(ring, "wb").close()
        assert knitkit_main(["shm-clean", "--directory", directory, "--dry-run"]) == 0
        assert len(_owned(directory, dead)) == 4
        assert knitkit_main(["shm-clean", "--directory", directory]) == 0
        assert _owned(directory, dead) == [] and not os.path.exists(ring)
        assert len(_owned(directory, os.getpid())) == 3
        np.testing.assert_array_equal(live.read(KEY), np.arange(8))
    finally:
        live.close()


def _owner_until_signalled(directory: str, conn) -> None:
    # Python's own SIGINT handling, whatever the test runner inherited (a shell's background
    # job starts with SIGINT ignored, and children keep that)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    backend = SharedMemoryBackend(slab_bytes=1 << 16, directory=directory, sweep=False)
    backend.put(KEY, np.arange(8, dtype=np.int32))
    conn.send("ready")
    conn.recv()  # blocks until the signal ends the process


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_nothing_is_left_after_an_owner_is_signalled(tmp_path: Path, signum: int) -> None:
    """An owner ended by SIGINT unlinks its segments itself (finalizer on the way out); after
    SIGTERM or SIGKILL (no Python code runs) whatever it left is gone once the next backend
    starts (its start-up sweep); a live backend in the same directory is never touched."""
    directory = str(tmp_path)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_owner_until_signalled, args=(directory, child))
    process.start()
    assert parent.poll(120) and parent.recv() == "ready"
    assert process.pid is not None
    assert len(_owned(directory, process.pid)) == 3
    os.kill(process.pid, signum)
    process.join(120)
    assert process.exitcode is not None and process.exitcode != 0
    if signum == signal.SIGINT:
        assert _owned(directory, process.pid) == []
    fresh = SharedMemoryBackend(directory=directory)
    assert _owned(directory, process.pid) == []
    fresh.close()
    assert os.listdir(directory) == []


def test_shm_clean_is_a_documented_command(capsys: pytest.CaptureFixture[str]) -> None:
    """``knitkit shm-clean --help`` documents the command."""
    with pytest.raises(SystemExit) as exit_info:
        knitkit_main(["shm-clean", "--help"])
    assert exit_info.value.code == 0
    assert "Remove /dev/shm segments" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["", ".", "..", "../etc/passwd", "a/b", "x\0y", "n" * 256])
def test_segment_names_cannot_leave_the_directory(name: str, tmp_path: Path) -> None:
    """A segment name is one file name: '..', '/', NUL, empty and over-long names are refused
    before anything is mapped, created or unlinked."""
    with pytest.raises(ValueError, match="segment name"):
        check_segment_name(name)
    if name in ("", ".", ".."):
        with pytest.raises(ValueError, match="segment name"):
            Slab(os.path.join(str(tmp_path), name), 4096, owner=True)
    assert os.listdir(tmp_path) == []


def _append(path: str, record: list) -> None:
    payload = json.dumps(record).encode()
    with open(path, "ab") as f:
        f.write(struct.pack("<I", len(payload)) + payload)


@pytest.mark.parametrize(
    "record",
    [
        ["slab", "../../etc/passwd", 4096],
        ["slab", "someone-elses-segment", 4096],
        ["put", "t9/tokens", 0, 1 << 30, "int32", [4]],
        ["put", "t9/tokens", 7, 0, "int32", [4]],
        ["put", "t9/tokens", 0, 0, "object", [4]],
        ["put", "t9/tokens", 0, 0, "int32", [-4]],
    ],
)
def test_readers_validate_journal_records(record: list) -> None:
    """A journal record naming a segment outside the owner's, or a unit outside its slab, is
    refused by the reader (it maps nothing foreign, reads no byte out of bounds)."""
    backend = SharedMemoryBackend(slab_bytes=1 << 16)
    try:
        backend.put(KEY, np.arange(4, dtype=np.int32))
        reader = pickle.loads(pickle.dumps(backend))
        _append(backend._journal.path, record)
        with pytest.raises(ValueError, match="journal"):
            reader.read(KEY)
        reader.close()
    finally:
        backend.close()


def test_segments_are_owner_only() -> None:
    """Slabs and the journal are created 0600."""
    backend = SharedMemoryBackend(slab_bytes=1 << 16)
    try:
        backend.put(KEY, np.arange(4, dtype=np.int32))
        for path in (*backend.paths, backend._journal.path):
            assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        backend.close()


def test_a_slot_ring_that_does_not_fit_is_an_oserror_naming_it() -> None:
    """Slot rings reserve their pages through the same helper as slabs (``slab.reserve``): a ring
    larger than /dev/shm raises ``OSError`` naming it at creation and leaves no segment, instead
    of a SIGBUS when a slot is first written."""
    stat = os.statvfs("/dev/shm")
    spec = RingSpec.new(
        num_slots=1, slot_bytes=stat.f_blocks * stat.f_frsize + (1 << 30), num_consumers=1
    )
    with pytest.raises(OSError, match=rf"{spec.name}.*bytes free"):
        SlotRing.create(spec)
    assert not os.path.exists(f"/dev/shm/{spec.name}")
