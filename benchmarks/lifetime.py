"""A benchmark's processes end with it: a SIGTERM runs its cleanup, and its children die with it.

A benchmark killed with SIGTERM (``timeout``, ``kill``, a CI job cancelled) used to die at once:
no ``finally`` ran, so its spawned rank processes and the Ray runtime its TransferQueue host
started lived on (stop 53: ~5 GB held until Ray's memory monitor killed the next run's actors).
``end_on_sigterm`` turns SIGTERM and SIGHUP into ``SystemExit`` in the main thread, so the
benchmark's ``finally`` blocks and atexit handlers (``ray.shutdown``) run; ``die_with_parent``,
called first in a spawned child, has the kernel send the child SIGTERM when its parent dies, even
by SIGKILL, so the child's own cleanup runs too; ``run_to_end`` runs a command (torchrun) that a
SIGTERM to the benchmark stops with a SIGTERM of its own, so it ends its workers.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
from types import FrameType
from typing import Any

_PR_SET_PDEATHSIG = 1
"""prctl option: the signal this process gets when the thread that created it exits."""
_GRACE_S = 60.0
"""How long a command told to end (SIGTERM) may take to end its own children."""


def end_on_sigterm() -> None:
    """SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread (call it there)."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit)


def die_with_parent() -> None:
    """In a ``multiprocessing`` child: get SIGTERM when the parent dies, and end the way
    ``end_on_sigterm`` does; exit at once if it is already gone. Linux only (elsewhere only the
    SIGTERM handler). The parent must start the child from a thread that outlives it (the kernel
    signals when the creating thread exits)."""
    end_on_sigterm()
    parent_process = multiprocessing.parent_process()
    if parent_process is None:
        raise RuntimeError("die_with_parent() is for a multiprocessing child")
    parent = parent_process.pid
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the death signal was set
        raise SystemExit(128 + signal.SIGTERM)


def run_to_end(command: list[str], *, timeout_s: float, **popen: Any) -> int:
    """Run ``command`` to its end (at most ``timeout_s``) and return its exit status. If this
    process is told to end meanwhile (``SystemExit`` from ``end_on_sigterm``, Ctrl-C) or the
    command runs past ``timeout_s``, the command gets SIGTERM, which torchrun passes on to its
    workers, and SIGKILL only if it is still running a minute later (``subprocess.run`` sends
    SIGKILL at once: torchrun's workers then lived on)."""
    with subprocess.Popen(command, **popen) as process:
        try:
            return process.wait(timeout_s)
        except BaseException:
            process.terminate()
            try:
                process.wait(_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
            raise


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
