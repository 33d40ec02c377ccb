"""A reorganizer process does not import its launcher's ``__main__`` module again (NOTE
[ Reorganizer child without the launcher's main ] in reorganizer_process.py): the launcher is
the user's training script, whose imports and unguarded top-level code a spawned child ran again
(on 93d88d7: 3.7 s, 3.8 s of CPU and 369 MiB per reorganizer under a script importing torch and
megatron.core)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery import reorganizer_process
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingSpec
from knitkit.types import UnitKey

WAIT_S = 120.0
"""Bound of the launcher script's run: generous, for a loaded machine."""

_LAUNCHER = textwrap.dedent(
    """
    import os
    import time

    with open({marker!r}, "a") as marker:  # top-level code, run wherever this module is imported
        marker.write(f"{{__name__}} {{os.getpid()}}\\n")

    from knitkit.storage.backends.shm import SharedMemoryBackend
    from knitkit.storage.delivery.consumer import MicroBatchConsumer
    from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
    from knitkit.storage.delivery.slot_ring import STARTING, RingSpec
    from knitkit.storage.planning.plan import EncoderRankPlan
    from knitkit.types import UnitKey
    import numpy as np

    if __name__ == "__main__":
        backend = SharedMemoryBackend(slab_bytes=1 << 16, directory={directory!r})
        key = UnitKey("t0", "image")
        backend.put(key, np.arange(12, dtype=np.float32).reshape(3, 4))
        spec = RingSpec.new(num_slots=2, slot_bytes=1 << 12, num_consumers=1)
        with ReorganizerProcess(backend, spec) as reorganizer:
            with MicroBatchConsumer(spec, 0) as consumer:
                reorganizer.submit("mb0", EncoderRankPlan("vision", 0, ((key,),)))
                with consumer.next_micro_batch(timeout_s={wait}) as lease:
                    print("SERVED", lease.layout.unit_views(lease.buffer)[key].sum(), reorganizer.pid, flush=True)
        backend.close()
    """
)

_MAIN_BACKEND = textwrap.dedent(
    """
    from knitkit.storage.backends.shm import SharedMemoryBackend
    from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
    from knitkit.storage.delivery.slot_ring import RingSpec


    class MainBackend(SharedMemoryBackend):
        '''A backend type of the launcher's __main__ module.'''


    if __name__ == "__main__":
        backend = MainBackend(slab_bytes=1 << 16, directory={directory!r})
        spec = RingSpec.new(num_slots=1, slot_bytes=1 << 12, num_consumers=1)
        try:
            ReorganizerProcess(backend, spec)
        except TypeError as error:
            print("REFUSED", error, flush=True)
        else:
            print("STARTED", flush=True)
        backend.close()
    """
)


def _run(script: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_reorganizer_serves_without_importing_its_launchers_main(
    tmp_path: Path, shm_dir: str
) -> None:
    """A launcher script whose top level records every import of it starts a reorganizer,
    which serves a micro-batch; the record shows the script ran once, as ``__main__`` in the
    launcher (on 93d88d7 the child added a line of its own, as ``__mp_main__``)."""
    marker = tmp_path / "imports.txt"
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER.format(marker=str(marker), directory=shm_dir, wait=WAIT_S))
    served = _run(script).split()
    assert served[:2] == ["SERVED", "66.0"], served
    lines = marker.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("__main__ "), lines
    assert lines[0].split()[1] != served[2], "the launcher's record came from the child"


def test_a_backend_type_of_the_launchers_main_is_refused_in_the_launcher(
    tmp_path: Path, shm_dir: str
) -> None:
    """A backend whose type the launcher's ``__main__`` defines cannot be rebuilt in the child:
    the launcher raises TypeError naming the type and where to move it, before any process
    starts (on 93d88d7 the child rebuilt it by importing the whole script again)."""
    script = tmp_path / "main_backend.py"
    script.write_text(_MAIN_BACKEND.format(directory=shm_dir))
    out = _run(script)
    assert out.startswith("REFUSED"), out
    assert "MainBackend is defined in the launcher's __main__ module" in out, out


def _large_store(directory: str) -> SharedMemoryBackend:
    """A store whose pickled index is several times a pipe's default 64 KiB buffer."""
    backend = SharedMemoryBackend(slab_bytes=1 << 20, directory=directory)
    for index in range(3000):
        backend.put(UnitKey(f"trajectory-{index:05d}", "tokens"), np.zeros(1, np.int32))
    return backend


def test_a_child_that_exits_before_reading_its_arguments_fails_the_start(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that exits at once (a broken interpreter or environment) while its launcher
    still writes its arguments fails the start with a RuntimeError naming its exit code, and
    leaves no ring behind (on c6d1ec6: a bare BrokenPipeError)."""
    monkeypatch.setattr(reorganizer_process, "_CHILD", "import sys; sys.exit(3)")
    backend = _large_store(shm_dir)
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 12, num_consumers=1)
    try:
        with pytest.raises(RuntimeError, match=r"exited \(code 3\) before it read its arguments"):
            ReorganizerProcess(backend, spec)
        assert not os.path.exists(f"/dev/shm/{spec.name}"), "the ring was left behind"
    finally:
        backend.close()


def test_a_child_that_never_reads_its_arguments_fails_the_start_within_its_bound(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that hangs before it reads its arguments fails the start once
    ``START_TIMEOUT_S`` passed (TimeoutError naming its pid), and is stopped (on c6d1ec6 the
    launcher waited, unbounded, for as long as the child hung)."""
    monkeypatch.setattr(reorganizer_process, "_CHILD", "import time; time.sleep(600)")
    monkeypatch.setattr(reorganizer_process, "START_TIMEOUT_S", 1.0)
    backend = _large_store(shm_dir)
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 12, num_consumers=1)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not read its arguments within 1 s") as error:
            ReorganizerProcess(backend, spec)
        assert time.monotonic() - started < WAIT_S
        pid = int(str(error.value).split("pid ")[1].split()[0])
        assert not os.path.exists(f"/proc/{pid}") or "Z" in _state(pid), "the child still runs"
    finally:
        backend.close()


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (``Z``: exited, not yet reaped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
