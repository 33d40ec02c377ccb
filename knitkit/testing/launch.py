"""Run a launcher (torchrun, a script that spawns ranks) so that a timeout ends its workers too."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Any

GRACE_S = 60.0
"""How long a launcher told to end (SIGTERM) may take to end its workers before SIGKILL."""


# NOTE [ Ending a launcher ]: ``subprocess.run(..., timeout=)`` answers a timeout (or any
# exception while it waits: Ctrl-C, a benchmark's SIGTERM turned into ``SystemExit``) with SIGKILL
# to the one process it started. A launcher killed that way cannot pass the end on: torchrun's
# workers, a script's spawned ranks, then run on as orphans (a hung gloo rank for its whole
# collective timeout, 30 minutes by default), on the two cores the rest of a test suite or a
# benchmark shares. ``run_to_end`` sends SIGTERM instead, which torchrun turns into the end of
# every worker, and SIGKILL only if the launcher is still there ``grace_s`` later.
def run_to_end(
    command: Sequence[str],
    *,
    timeout_s: float,
    grace_s: float = GRACE_S,
    capture_output: bool = False,
    **popen: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(command, timeout=timeout_s, capture_output=...)``, ending the command with
    SIGTERM, then SIGKILL after ``grace_s``, on a timeout or an exception while it runs (NOTE
    [ Ending a launcher ]); raises ``subprocess.TimeoutExpired`` (with what it printed) or that
    exception once the command is gone. ``popen``: ``subprocess.Popen``'s other arguments."""
    if capture_output:
        popen |= {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with subprocess.Popen(list(command), **popen) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as expired:
            stdout, stderr = _end(process, grace_s)
            raise subprocess.TimeoutExpired(
                process.args, timeout_s, output=stdout, stderr=stderr
            ) from expired
        except BaseException:
            _end(process, grace_s)
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _end(process: subprocess.Popen[Any], grace_s: float) -> tuple[Any, Any]:
    """SIGTERM ``process``, SIGKILL it if it outlives ``grace_s``; what it printed meanwhile
    (nothing after a SIGKILL: a worker it left may hold its pipes open, so only the process is
    waited for, as ``subprocess.run`` does)."""
    process.terminate()
    try:
        return process.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None, None
