"""A benchmark's processes end with it: a SIGTERM runs its cleanup, and its children die with it.

A benchmark killed with SIGTERM (``timeout``, ``kill``, a CI job cancelled) used to die at once:
no ``finally`` ran, so its spawned rank processes and the Ray runtime its TransferQueue host
started lived on (stop 53: ~5 GB held until Ray's memory monitor killed the next run's actors).
``end_on_sigterm`` turns SIGTERM and SIGHUP into ``SystemExit`` in the main thread, so the
benchmark's ``finally`` blocks and atexit handlers (``ray.shutdown``) run; ``die_with_parent``,
called first in a spawned child, has the kernel send the child SIGTERM when its parent dies, even
by SIGKILL, so the child's own cleanup runs too. A command a benchmark runs (torchrun) goes
through ``knitkit.testing.run_to_end``, which ends it with a SIGTERM of its own (so it ends its
workers) when the benchmark is told to end or the command runs past its bound.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from types import FrameType

_PR_SET_PDEATHSIG = 1
"""prctl option: the signal this process gets when the thread that created it exits."""


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


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
