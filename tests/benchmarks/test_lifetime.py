"""A killed benchmark cleans up: SIGTERM runs its ``finally``, and a spawned child dies with it
even when it is killed with SIGKILL (benchmarks/lifetime.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from processes import BOUND_S, gone, wait_until

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, {benchmarks!r})
    from lifetime import die_with_parent, end_on_sigterm

    OUT = Path({out!r})


    def child() -> None:
        die_with_parent()
        try:
            (OUT / "child").write_text("running")
            time.sleep(600)
        finally:
            (OUT / "child-cleaned").write_text("yes")


    if __name__ == "__main__":
        end_on_sigterm()
        process = mp.get_context("spawn").Process(target=child)
        process.start()
        try:
            (OUT / "parent").write_text(str(process.pid))
            time.sleep(600)
        finally:  # as transfer.py's: its children end with the run
            (OUT / "parent-cleaned").write_text("yes")
            process.terminate()
            process.join(60)
    """
)


def _written(path: Path) -> None:
    wait_until(path.exists, f"{path.name} written")


def _start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    script = tmp_path / "bench.py"
    script.write_text(SCRIPT.format(benchmarks=str(BENCHMARKS), out=str(tmp_path)))
    parent = subprocess.Popen([sys.executable, str(script)])
    _written(tmp_path / "parent")
    _written(tmp_path / "child")
    return parent, int((tmp_path / "parent").read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_sigterm_runs_the_benchmark_s_cleanup_and_ends_its_child(tmp_path: Path) -> None:
    """SIGTERM: the parent's ``finally`` runs (it ends its child, which runs its own) and the
    parent exits 128 + 15 (before: it died at once, its child lived on)."""
    parent, child = _start(tmp_path)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(BOUND_S) == 128 + signal.SIGTERM
    assert (tmp_path / "parent-cleaned").exists()
    _written(tmp_path / "child-cleaned")
    wait_until(lambda: gone(child), f"child {child} ending with its parent")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_ends_when_its_benchmark_is_killed_outright(tmp_path: Path) -> None:
    """SIGKILL of the parent (no cleanup of its own can run): the child still gets SIGTERM from
    the kernel, runs its ``finally`` and exits."""
    parent, child = _start(tmp_path)
    parent.kill()
    parent.wait(BOUND_S)
    assert not (tmp_path / "parent-cleaned").exists()
    _written(tmp_path / "child-cleaned")
    wait_until(lambda: gone(child), f"child {child} ending with its parent")
