"""``knitkit.testing.run_to_end``: a launcher that runs past its timeout is told to end (SIGTERM), so
it ends its workers, and is killed only if it ignores that (NOTE [ Ending a launcher ])."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from processes import BOUND_S, gone, kill_left, wait_until

from knitkit.testing import run_to_end

LAUNCHER = textwrap.dedent(
    """
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    out, mode = Path(sys.argv[1]), sys.argv[2]
    worker = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM}),
    )


    def told(signum, frame):
        (out / "told").write_text(str(signum))
        if mode == "passes-on":  # as torchrun does: its workers end, then it does
            worker.terminate()
            worker.wait()
            sys.exit(0)


    signal.signal(signal.SIGTERM, told)
    (out / "pids").write_text(f"{os.getpid()} {worker.pid}")
    print("workers started", flush=True)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    while True:
        signal.pause()
    """
)


def _blocking_sigterm() -> None:
    """In the launcher before exec: SIGTERM waits until its handler is set (the mask survives
    exec), so a timeout shorter than the interpreter's start is still seen by the handler."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _launch(tmp_path: Path, mode: str, **kwargs: object) -> subprocess.TimeoutExpired:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_to_end(
            [sys.executable, str(script), str(tmp_path), mode],
            preexec_fn=_blocking_sigterm,
            **kwargs,  # type: ignore[arg-type]
        )
    return expired.value


def test_a_launcher_past_its_timeout_is_told_to_end_and_ends_its_workers(tmp_path: Path) -> None:
    """SIGTERM, not SIGKILL: the launcher passes it on and its worker ends with it (with
    ``subprocess.run`` the worker ran on); what it printed comes with ``TimeoutExpired``."""
    expired = _launch(tmp_path, "passes-on", timeout_s=0.5, capture_output=True, text=True)
    assert (tmp_path / "told").read_text() == str(int(signal.SIGTERM))
    assert "workers started" in expired.output
    launcher, worker = map(int, (tmp_path / "pids").read_text().split())
    assert gone(launcher)  # run_to_end returned once it had ended
    wait_until(lambda: gone(worker), f"worker {worker} gone")


def test_a_launcher_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    """A launcher that stays after SIGTERM gets SIGKILL ``grace_s`` later; the call still raises
    ``TimeoutExpired`` and returns only once the launcher is gone."""
    try:
        _launch(tmp_path, "stubborn", timeout_s=0.5, grace_s=0.5, capture_output=True)
        assert (tmp_path / "told").exists()
        launcher, _ = map(int, (tmp_path / "pids").read_text().split())
        assert gone(launcher)
    finally:  # the stubborn launcher's worker is orphaned by design: end it here
        if (tmp_path / "pids").exists():
            kill_left([int((tmp_path / "pids").read_text().split()[1])])


def test_a_command_that_ends_in_time_runs_as_with_subprocess_run() -> None:
    done = run_to_end(
        [sys.executable, "-c", "import sys; print('out'); sys.exit(3)"],
        timeout_s=BOUND_S,
        capture_output=True,
        text=True,
    )
    assert (done.returncode, done.stdout) == (3, "out\n")
