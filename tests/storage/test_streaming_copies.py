"""A reorganizer process's slot fills stream past the cache (NOTE [ Streaming fills ] in
knitkit/storage/delivery/streaming_copies.py): it starts with glibc's non-temporal threshold
lowered, unless its launcher set that tunable itself."""

from __future__ import annotations

import os
import subprocess
import time
from itertools import takewhile
from pathlib import Path

import pytest

from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingSpec
from knitkit.storage.delivery.streaming_copies import (
    FILL_THRESHOLD_BYTES,
    NON_TEMPORAL_THRESHOLD,
    TUNABLES,
    streaming_copies,
)

OURS = f"{NON_TEMPORAL_THRESHOLD}={FILL_THRESHOLD_BYTES:#x}"


def test_the_threshold_is_added_to_the_tunables_a_launcher_has_and_its_own_choice_kept() -> None:
    assert streaming_copies({"PATH": "/bin"}) == {"PATH": "/bin", TUNABLES: OURS}
    other = "glibc.malloc.arena_max=2"
    assert streaming_copies({TUNABLES: other})[TUNABLES] == f"{other}:{OURS}"
    chosen = f"{other}:{NON_TEMPORAL_THRESHOLD}=0x100000"
    assert streaming_copies({TUNABLES: chosen}) == {TUNABLES: chosen}
    assert streaming_copies({TUNABLES: ""})[TUNABLES] == OURS


EXEC_WAIT_S = 120.0
"""Bound of the wait for the child's exec (generous: a loaded 2-core machine)."""


def _child_tunables(pid: int) -> str | None:
    """``GLIBC_TUNABLES`` as process ``pid`` was started with it, once it runs the reorganizer's
    command. /proc shows the process's first environment block, in which glibc's loader ended
    each tunable it parsed with a NUL (the process's own ``environ`` is a copy), so the tunables
    after the first are rejoined. Until its exec, the child (vfork) shows its launcher's first
    block: beside two busy loops the test read it there once and found no tunables at all."""
    deadline = time.monotonic() + EXEC_WAIT_S
    while b"_child_main" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, f"pid {pid} did not exec within {EXEC_WAIT_S} s"
        time.sleep(0.01)
    items = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    prefix = f"{TUNABLES}="
    for index, item in enumerate(items):
        if item.startswith(prefix):
            following = takewhile(lambda x: x.startswith("glibc."), items[index + 1 :])
            return ":".join([item[len(prefix) :], *following])
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize(
    "launcher", [None, "glibc.malloc.arena_max=2", f"{NON_TEMPORAL_THRESHOLD}=0x8000"]
)
def test_a_reorganizer_process_starts_with_the_threshold(
    launcher: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child starts with the tunables ``streaming_copies`` makes of the launcher's (read
    from /proc/<pid>/environ); the launcher's own environment is unchanged."""
    if launcher is None:
        monkeypatch.delenv(TUNABLES, raising=False)
    else:
        monkeypatch.setenv(TUNABLES, launcher)
    backend = SharedMemoryBackend(slab_bytes=1 << 16)
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 12, num_consumers=1)
    try:
        with ReorganizerProcess(backend, spec) as reorganizer:
            assert reorganizer.pid is not None
            got = _child_tunables(reorganizer.pid)
        assert got == streaming_copies(dict(os.environ))[TUNABLES]
        assert os.environ.get(TUNABLES) == launcher
    finally:
        backend.close()


def _loader() -> str | None:
    for path in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-x86-64.so.2"):
        if os.path.exists(path):
            return path
    return None


@pytest.mark.skipif(_loader() is None, reason="no x86-64 glibc loader: the tunable is ignored")
def test_glibc_reads_the_threshold_as_set() -> None:
    """The tunable's name and value are ones this glibc takes (``ld.so --list-tunables``, glibc
    2.33+): a misspelt name or a value below glibc's minimum would be dropped silently."""
    loader = _loader()
    assert loader is not None
    listed = subprocess.run(
        [loader, "--list-tunables"], env=streaming_copies({}), capture_output=True, text=True
    )
    if listed.returncode != 0 or NON_TEMPORAL_THRESHOLD not in listed.stdout:
        pytest.skip(f"{loader} cannot list its tunables (glibc before 2.33)")
    line = next(x for x in listed.stdout.splitlines() if x.startswith(NON_TEMPORAL_THRESHOLD))
    assert int(line.split(":")[1].split()[0], 16) == FILL_THRESHOLD_BYTES, line
