"""Interpreter exit with prefetch threads inside their sources: end them, keep the loop's exit status."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading

# NOTE [ Exit with a thread inside the source ]
# Lifecycle table: docs/lifecycle.md.
# CPython kills daemon threads that touch the GIL once finalization has begun (pthread_exit).
# If such a thread is inside C++ (a torch op in the source's next(), which releases the GIL),
# the forced unwind meets a noexcept frame and the process aborts: "terminate called without an
# active exception", status -6 instead of the training loop's 0, 1 or 130.
# So no prefetch thread may still run when finalization begins. The prefetch module's atexit hook
# (worker.py) runs before finalization; it sets `stop` on every live prefetch thread, calls the
# source's interrupt() (a MicroBatchConsumer's wait ends at once), and raises SourceAbandoned
# asynchronously (`abandon`, PyThreadState_SetAsyncExc) in a thread that is inside a source
# without interrupt(): it lands as soon as that thread runs Python bytecode again (between two
# torch ops of a collate, in a Python loop), unwinds the source (its `finally` blocks run) and
# ends the thread. It then joins each thread for its join_timeout_s. The hook does not end the
# process: the interpreter exits normally, so every atexit handler (a logger flush,
# `wandb.finish`, an async checkpoint writer, a process-group teardown) runs, the ones the
# trainer registered before importing knitkit included, and the status is the loop's own.
# A thread can still be alive after that only inside ONE C call longer than join_timeout_s (a
# blocking read without a timeout, a huge op). The user chooses what then happens:
#   - `MicroBatchIterator.Config(exit_on_stuck_source=False)` (default): finalization goes on.
#     If the call never returns the process exits normally; if it returns during the few
#     milliseconds of finalization the process aborts (the CPython behaviour above);
#   - `exit_on_stuck_source=True`: `exit_now()` ends the process at once without finalization
#     (os._exit after flushing stdio and logging) with the status the interpreter would have
#     used, skipping the atexit handlers registered before knitkit.microbatch_iter was imported:
#       an uncaught exception (sys.last_value, set before atexit hooks run): 1;
#       an uncaught KeyboardInterrupt: death by SIGINT, as CPython does (shell status 130);
#       SystemExit seen by an iterator's `with` block (note_exit): its code;
#       otherwise 0 (a SystemExit raised outside any iterator's `with` reads as 0).
# Shared memory of knitkit's reorganizers is unlinked by the resource tracker on either path.

_system_exit: SystemExit | None = None


class SourceAbandoned(BaseException):
    """Raised at interpreter exit inside a prefetch thread's source (NOTE [ Exit with a thread
    inside the source ]); a BaseException, so a source's ``except Exception`` lets it pass."""


def abandon(thread: threading.Thread) -> None:
    """Raise ``SourceAbandoned`` in ``thread`` when it next runs Python bytecode."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(SourceAbandoned)
        )


def note_exit(error: BaseException | None) -> None:
    """Remember a SystemExit leaving an iterator's ``with`` block (its code is the exit status)."""
    global _system_exit
    if isinstance(error, SystemExit):
        _system_exit = error


def exit_status() -> int | None:
    """The status the interpreter is exiting with; None for death by SIGINT (see NOTE [ Exit with a
    thread inside the source ])."""
    last = getattr(sys, "last_value", None)
    if isinstance(last, KeyboardInterrupt):
        return None
    if last is not None:
        return 1
    if _system_exit is not None:
        code = _system_exit.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


def exit_now() -> None:
    """End the process now, without finalization, with ``exit_status()`` (see NOTE [ Exit with a
    thread inside the source ])."""
    status = exit_status()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    if status is None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT  # not reached: the default action ends the process
    os._exit(status)
