"""Who may remove or clean up a shared-memory backend's segments: owner locks across pid
namespaces, forked children, shrunk slabs, hostile directory entries (issue 22, items 1, 2, 5, 10)."""

from __future__ import annotations

import base64
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from shm_processes import python, unshare_pid

from knitkit.cli import main as knitkit_main
from knitkit.storage.backends.lost import UnitsLostError
from knitkit.storage.backends.segments import pid_alive, segment_pid
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.types import UnitKey, UnitRead

KEY = UnitKey("t0", "tokens")
WAIT_S = 120


def _owned(directory: str, pid: int) -> list[str]:
    return sorted(n for n in os.listdir(directory) if segment_pid(n) == pid)


def _data(directory: str, pid: int) -> list[str]:
    """An owner's slabs and journal (its lock file aside)."""
    return [n for n in _owned(directory, pid) if not n.endswith("-lock")]


_SWEEP_AND_CLEAN = """
    import sys
    from knitkit.cli import main
    from knitkit.storage.backends.shm import SharedMemoryBackend
    SharedMemoryBackend(directory=sys.argv[1]).close()  # its start-up sweep
    sys.exit(main(["shm-clean", "--directory", sys.argv[1]]))
"""


def test_a_sweep_in_another_pid_namespace_keeps_a_live_owners_segments(shm_dir: str) -> None:
    """A backend started in a second pid namespace that shares /dev/shm (and ``knitkit
    shm-clean`` there) sees this process's pid as dead; it must still keep this live owner's
    slab, journal and lock, and new readers still read every unit."""
    prefix = unshare_pid()
    owner = SharedMemoryBackend(slab_bytes=1 << 16, directory=shm_dir)
    try:
        owner.put(KEY, np.arange(8, dtype=np.int32))
        before = _owned(shm_dir, os.getpid())
        assert len(_data(shm_dir, os.getpid())) == 2
        code = _SWEEP_AND_CLEAN.replace("sys.argv[1]", repr(shm_dir))
        probe = python(
            f"import os; print(os.path.exists('/proc/{os.getpid()}'))\n" + textwrap.dedent(code),
            *prefix,
        )
        out, err = probe.communicate(timeout=WAIT_S)
        assert probe.returncode == 0, err
        assert out.splitlines()[0] == "False"  # our pid is not visible over there
        assert _owned(shm_dir, os.getpid()) == before
        owner.put(UnitKey("t1", "tokens"), np.arange(4, dtype=np.int32))
        reader = pickle.loads(pickle.dumps(owner))
        np.testing.assert_array_equal(reader.read(KEY), np.arange(8))
        np.testing.assert_array_equal(reader.read(UnitKey("t1", "tokens")), np.arange(4))
        reader.close()
    finally:
        owner.close()
    assert _owned(shm_dir, os.getpid()) == []


_OWNER_AT_PID = """
    import base64, os, pickle, signal, sys
    import numpy as np
    target, directory = {target}, {directory!r}
    while True:  # pids in a fresh namespace count up: let children take them until ours is next
        child = os.fork()
        if child == 0:
            if os.getpid() != target:
                os._exit(0)
            break
        os.waitpid(child, 0)
        if child >= target:
            sys.exit(0 if child == target else 3)
    from knitkit.storage.backends.shm import SharedMemoryBackend
    from knitkit.types import UnitKey
    backend = SharedMemoryBackend(slab_bytes=1 << 16, directory=directory, sweep=False)
    backend.put(UnitKey("t0", "tokens"), np.arange(8, dtype=np.int32))
    print(os.getpid(), base64.b64encode(pickle.dumps(backend)).decode(), flush=True)
    command = sys.stdin.readline().strip()
    if command == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    backend.close()
    print("closed", flush=True)
"""


def _dead_pid_here(start: int = 40) -> int:
    """A small pid no process of this namespace has now."""
    return next(p for p in range(start, 1 << 15) if not pid_alive(p))


@pytest.mark.parametrize("end", ["close", "kill"])
def test_an_owner_in_another_pid_namespace_is_kept_while_it_lives(shm_dir: str, end: str) -> None:
    """An owner running in a second pid namespace under a pid that is dead in ours: our sweep
    and ``knitkit shm-clean`` keep its segments while it lives (we read its units meanwhile);
    after it closes nothing is left, and after a SIGKILL our sweep removes what it left."""
    prefix = unshare_pid()
    target = _dead_pid_here()
    inner = python(_OWNER_AT_PID.format(target=target, directory=shm_dir), *prefix)
    try:
        assert inner.stdout is not None and inner.stdin is not None
        line = inner.stdout.readline().split()
        assert line, inner.stderr.read() if inner.stderr else ""
        pid, blob = int(line[0]), line[1]
        assert pid == target and not pid_alive(pid)  # its pid means nothing here
        assert len(_data(shm_dir, pid)) == 2
        SharedMemoryBackend(directory=shm_dir).close()  # start-up sweep here
        assert knitkit_main(["shm-clean", "--directory", shm_dir]) == 0
        assert len(_data(shm_dir, pid)) == 2
        reader = pickle.loads(base64.b64decode(blob))  # test-only: our own child's bytes
        np.testing.assert_array_equal(reader.read(KEY), np.arange(8))
        reader.close()
        inner.stdin.write(f"{end}\n")
        inner.stdin.flush()
        inner.wait(WAIT_S)
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait(WAIT_S)
    if end == "close":
        assert _owned(shm_dir, target) == []
    else:
        assert len(_data(shm_dir, target)) == 2  # SIGKILL: nothing ran
        SharedMemoryBackend(directory=shm_dir).close()
        assert _owned(shm_dir, target) == []


def _owner_forks_a_lock_holder(directory: str, reply: int, hold: int) -> None:
    """Make a backend, fork a child that inherits its lock and waits, then exit (pid gone)."""
    backend = SharedMemoryBackend(slab_bytes=1 << 16, directory=directory, sweep=False)
    backend.put(KEY, np.arange(8, dtype=np.int32))
    child = os.fork()
    if child == 0:
        os.read(hold, 1)  # lives (holding the inherited lock) until the test says so
        os._exit(0)
    blob = pickle.dumps((os.getpid(), child, pickle.dumps(backend)))
    os.write(reply, len(blob).to_bytes(8, "little") + blob)
    os._exit(0)  # with the backend alive: the owner's pid is dead from here on, its lock is not


def _read_exactly(fd: int, size: int) -> bytes:
    out = b""
    while len(out) < size:
        chunk = os.read(fd, size - len(out))
        assert chunk, "the owner process died before it answered"
        out += chunk
    return out


def test_liveness_is_the_lock_not_the_pid_in_the_name(tmp_path: Path) -> None:
    """Without a second namespace: segments whose named pid is dead but whose owner lock is held
    (here by a forked child that inherited it, as a process in another namespace holds it) are
    kept by the sweep and ``shm-clean``; once the lock's last holder exits they are removed."""
    directory = str(tmp_path)
    reply_r, reply_w = os.pipe()
    hold_r, hold_w = os.pipe()
    owner = os.fork()
    if owner == 0:
        try:
            _owner_forks_a_lock_holder(directory, reply_w, hold_r)
        finally:
            os._exit(1)
    os.close(reply_w)
    os.close(hold_r)
    size = int.from_bytes(_read_exactly(reply_r, 8), "little")
    dead, holder, blob = pickle.loads(_read_exactly(reply_r, size))
    os.waitpid(owner, 0)
    assert dead == owner and not pid_alive(dead)
    try:
        assert len(_data(directory, dead)) == 2
        SharedMemoryBackend(directory=directory).close()
        assert knitkit_main(["shm-clean", "--directory", directory]) == 0
        assert len(_data(directory, dead)) == 2
        reader = pickle.loads(blob)
        np.testing.assert_array_equal(reader.read(KEY), np.arange(8))
        reader.close()
    finally:
        os.write(hold_w, b"x")
        os.close(hold_w)
        os.close(reply_r)
        deadline = time.monotonic() + WAIT_S
        while pid_alive(holder) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not pid_alive(holder)
    SharedMemoryBackend(directory=directory).close()
    assert _owned(directory, dead) == []


_FORK_THEN_EXIT = """
    import os, sys
    import numpy as np
    from knitkit.storage.backends.shm import SharedMemoryBackend
    from knitkit.types import UnitKey
    backend = SharedMemoryBackend(slab_bytes=1 << 16, directory={directory!r})
    for i in range(3):
        backend.put(UnitKey(f"t{{i}}", "tokens"), np.arange(8, dtype=np.int32) + i)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(write_end)
        os.read(read_end, 1)  # the parent has written more meanwhile
        # a forked child reads its parent's store, including units put after the fork ...
        assert backend.read(UnitKey("t3", "tokens")).tolist() == list(range(3, 11))
        assert sorted(str(k) for k in backend.keys()) == ["t0/tokens", "t2/tokens", "t3/tokens"]
        try:
            backend.put(UnitKey("x", "tokens"), np.arange(2))
        except RuntimeError as exc:
            assert "forked child" in str(exc), exc
        else:
            raise AssertionError("a forked child wrote into its parent's store")
        if {explicit_close}:
            backend.close()
        sys.exit(0)  # ... and exits normally: atexit and every finalizer run here
    os.close(read_end)
    backend.put(UnitKey("t3", "tokens"), np.arange(8, dtype=np.int32) + 3)
    backend.delete(UnitKey("t1", "tokens"))
    os.write(write_end, b"x")
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    backend.put(UnitKey("t4", "tokens"), np.arange(8, dtype=np.int32) + 4)
    for path in backend.paths:
        assert os.path.exists(path), path
    for i in (0, 2, 3, 4):
        assert backend.read(UnitKey(f"t{{i}}", "tokens")).tolist() == list(range(i, i + 8))
    backend.close()
    print("ok")
"""


@pytest.mark.parametrize("explicit_close", [False, True])
def test_a_forked_child_that_exits_leaves_its_parents_store_alone(
    tmp_path: Path, explicit_close: bool
) -> None:
    """A child forked from the owner (a DataLoader worker, a fork-started helper) reads the
    parent's store as a reader (later puts and deletes included), cannot write into it, and when
    it exits normally (its finalizers run) or closes its copy, the parent's slabs, journal and
    lock stay: the parent keeps writing and reading; clean-up runs only in the owner."""
    code = _FORK_THEN_EXIT.format(directory=str(tmp_path), explicit_close=explicit_close)
    run = python(code, stdin=subprocess.DEVNULL)
    out, err = run.communicate(timeout=WAIT_S)
    assert run.returncode == 0 and out.strip() == "ok", err
    assert os.listdir(tmp_path) == []  # the owner's own exit cleaned up


def _read_after_truncation(blob: bytes, conn) -> None:
    reader = pickle.loads(blob)
    size = os.stat(reader.paths[0]).st_size
    os.truncate(reader.paths[0], size // 4)  # any process of this user may do this
    out = []
    for attempt in (
        lambda: reader.read(UnitKey("t9", "tokens")),
        lambda: reader.view(UnitKey("t9", "tokens")),
        lambda: reader.read_many(
            [UnitRead(UnitKey("t9", "tokens"))], [np.empty(4096, dtype=np.int64)]
        ),
    ):
        try:
            attempt()
            out.append("read")
        except UnitsLostError as exc:
            out.append((type(exc).__name__, [str(k) for k in exc.keys], str(exc)))
    conn.send(out)


def test_a_shrunk_slab_is_an_error_naming_its_units_not_a_sigbus(tmp_path: Path) -> None:
    """A same-user process truncates a slab under a reader: ``read``, ``view`` and ``read_many``
    raise ``UnitsLostError`` naming the segment and the unit asked for, instead of dying of
    SIGBUS (the reader runs in its own process so a SIGBUS would show as its exit code); the
    owner's next put into that slab is an ``OSError`` naming it, and changes nothing."""
    owner = SharedMemoryBackend(slab_bytes=1 << 16, directory=str(tmp_path))
    try:
        owner.put(UnitKey("t0", "tokens"), np.arange(8, dtype=np.int64))
        owner.put(UnitKey("t9", "tokens"), np.arange(4096, dtype=np.int64))
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_read_after_truncation, args=(pickle.dumps(owner), child))
        process.start()
        process.join(WAIT_S)
        assert process.exitcode == 0, f"reader died: exit code {process.exitcode}"
        results = parent.recv()
        assert len(results) == 3
        for name, keys, message in results:
            assert name == "UnitsLostError"
            assert keys == ["t9/tokens"]
            assert owner.paths[0] in message and "truncated" in message
        with pytest.raises(OSError, match="truncated"):
            owner.put(UnitKey("t10", "tokens"), np.arange(4, dtype=np.int64))
        assert sorted(map(str, owner.keys())) == ["t0/tokens", "t9/tokens"]
    finally:
        owner.close()


@pytest.mark.parametrize("shape", ["slab", "lock"])
def test_a_directory_named_like_a_dead_owners_segment_breaks_nothing(
    tmp_path: Path, shape: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory (not a file) named like a dead owner's slab or lock file: every new backend in
    that directory starts and works, and ``knitkit shm-clean`` succeeds, naming what it skipped
    and why; the directory itself is never removed."""
    dead = _dead_pid_here(1 << 14)
    odd = tmp_path / f"knitkit-{dead}-deadbeef-{shape}"
    odd.mkdir()
    (tmp_path / f"knitkit-{dead}-deadbeef-slab1").write_bytes(b"")  # a real leftover file
    backend = SharedMemoryBackend(slab_bytes=1 << 16, directory=str(tmp_path))
    backend.put(KEY, np.arange(4, dtype=np.int32))
    np.testing.assert_array_equal(backend.read(KEY), np.arange(4))
    backend.close()
    assert knitkit_main(["shm-clean", "--directory", str(tmp_path)]) == 0
    assert f"skipped {odd}: not a regular file" in capsys.readouterr().out
    assert odd.is_dir()


def test_the_sweep_never_removes_a_live_owner_in_this_namespace(tmp_path: Path) -> None:
    """Two live backends in one directory, and a sweep by each: nothing of either is removed."""
    first = SharedMemoryBackend(slab_bytes=1 << 16, directory=str(tmp_path))
    first.put(KEY, np.arange(4, dtype=np.int32))
    second = SharedMemoryBackend(slab_bytes=1 << 16, directory=str(tmp_path))
    second.put(KEY, np.arange(5, dtype=np.int32))
    assert knitkit_main(["shm-clean", "--directory", str(tmp_path)]) == 0
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(first)).read(KEY), np.arange(4))
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(second)).read(KEY), np.arange(5))
    first.close()
    second.close()
    assert os.listdir(tmp_path) == []


def test_an_owner_ended_by_sigterm_is_swept(tmp_path: Path) -> None:
    """SIGTERM with its default action runs no Python code: the owner lock dies with the
    process and the next sweep removes everything it left."""
    process = python(
        f"""
        import sys, numpy as np
        from knitkit.storage.backends.shm import SharedMemoryBackend
        from knitkit.types import UnitKey
        b = SharedMemoryBackend(slab_bytes=1 << 16, directory={str(tmp_path)!r}, sweep=False)
        b.put(UnitKey("t0", "tokens"), np.arange(4))
        print("ready", flush=True)
        sys.stdin.readline()
        """
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    os.kill(process.pid, signal.SIGTERM)
    process.wait(WAIT_S)
    assert len(_data(str(tmp_path), process.pid)) == 2
    SharedMemoryBackend(directory=str(tmp_path)).close()
    assert os.listdir(tmp_path) == []
