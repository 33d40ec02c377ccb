"""SIGTERM becomes a clean exit while knitkit's child processes are open, and only where it was SIG_DFL."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

# NOTE [ SIGTERM while child processes are open ]
#
# Lifecycle table: docs/lifecycle.md.
# SIGTERM's default action ends the process without `finally` blocks or finalizers, leaving the
# store's /dev/shm segments and the reorganizer processes' rings to the sweeps, and the ranks of
# `knitkit check-equivalence --nproc` to their watch threads, which end them with no teardown
# (NOTE [ Ranks end with their starter ] in integration/megatron/testing/world.py; before those,
# they ran on as orphans). While at least one ReorganizerProcess is open, or that command runs its
# ranks (`held` around its `World`: integration/megatron/testing/cli.py; a `World` alone does not
# hold it, since inside a test runner a SystemExit fails the running test and the run goes on,
# where SIGTERM's default stops it), a process-wide count under a lock, and only if SIGTERM's
# disposition is SIG_DFL when one opens in the main thread (signal.signal works nowhere else),
# knitkit's handler turns SIGTERM into SystemExit(143), so every `with` block and finalizer
# closes what it opened. The last close in the main thread restores SIG_DFL, but only if
# knitkit's handler is still the installed one. The trainer's choices always win:
# - SIG_IGN stays ignored;
# - a handler of its own is never replaced or wrapped: it decides (if it ends the interpreter the
#   finalizers clean up; one that saves a checkpoint first keeps its micro-batches flowing);
# - a handler installed after knitkit's stays installed after the last close; if it chains to
#   knitkit's, that raises SystemExit while children are open and returns otherwise.
# A SIGTERM delivered to knitkit's handler with nothing open (it could not be restored: the last
# close ran in another thread) acts as the SIG_DFL it replaced: the process dies by the signal.
# A forked child inherits the count, so SIGTERM there is a SystemExit of the child alone (its
# clean-ups of the parent's resources are no-ops: NOTE [ Owner-only clean-up ]).


class SigtermExits:
    """The process-wide SIGTERM policy of open child processes (NOTE [ SIGTERM while child
    processes are open ]); one instance, ``sigterm_exits``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0

    def hold(self) -> None:
        """One more child process (or world of them) open; installs the handler over SIG_DFL
        (main thread only)."""
        with self._lock:
            self._open += 1
            if _in_main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, self._on_sigterm)

    def release(self) -> None:
        """One fewer; the last one restores SIG_DFL if knitkit's handler is still installed."""
        with self._lock:
            self._open -= 1
            if (
                self._open == 0
                and _in_main_thread()
                and signal.getsignal(signal.SIGTERM) == self._on_sigterm
            ):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """``hold`` for the block: a program that owns children for the whole block."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes, maybe inside hold(): never take the lock.
        if self._open:
            raise SystemExit(128 + signum)
        if signal.getsignal(signum) == self._on_sigterm:  # delivered to us: act as SIG_DFL
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        # else a later handler chained to us with nothing open: nothing of ours to clean up


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


sigterm_exits = SigtermExits()
