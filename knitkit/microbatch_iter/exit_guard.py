"""Exit with the training loop's own status when a prefetch thread cannot stop before finalization."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

# NOTE [ Exit with a thread inside the source ]
# CPython kills daemon threads that touch the GIL once finalization has begun (pthread_exit).
# If such a thread is inside C++ (a torch op in the source's next(), which releases the GIL),
# the forced unwind meets a noexcept frame and the process aborts: "terminate called without an
# active exception", status -6 instead of the training loop's 0, 1 or 130.
# The prefetch module's atexit hook (worker.py) runs BEFORE finalization starts: it sets `stop`
# on every live prefetch thread and joins each for its join_timeout_s, so a source whose next()
# returns in that time (a torch collate) ends the thread and the interpreter exits normally.
# A thread still alive after that is inside a long or stuck next(): then `exit_now()` ends the
# process without finalization (os._exit after flushing stdio and logging), with the status the
# interpreter would have used:
#   - an uncaught exception (sys.last_value, set before atexit hooks run): 1;
#   - an uncaught KeyboardInterrupt: death by SIGINT, as CPython does (shell status 130);
#   - SystemExit seen by an iterator's `with` block (note_exit): its code;
#   - otherwise 0 (a normal end; a SystemExit raised outside any iterator's `with` while a
#     source is stuck reads as 0: close the iterator, or exit through its `with`).
# atexit handlers registered before knitkit.microbatch_iter was imported do not run on that path;
# shared memory of knitkit's reorganizers is still unlinked by the resource tracker.

_system_exit: SystemExit | None = None


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
