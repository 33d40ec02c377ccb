"""A reorganizer process does not import its launcher's ``__main__`` module again (NOTE
[ Reorganizer child without the launcher's main ] in reorganizer_process.py): the launcher is
the user's training script, whose imports and unguarded top-level code a spawned child ran again
(on 93d88d7: 3.7 s, 3.8 s of CPU and 369 MiB per reorganizer under a script importing torch and
megatron.core)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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
