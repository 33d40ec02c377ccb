"""Process exit while the prefetch thread runs torch inside the source: the loop's own status."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from knitkit.microbatch_iter import MicroBatchIterator
    torch.set_num_threads(1)

    def source():  # a torch-based collate: the thread spends its time inside torch ops
        yield {"x": torch.zeros(2)}
        while True:
            a = torch.randn(128, 128)
            for _ in range(1_000_000):
                a = torch.tanh(a @ a)
            yield {"x": a}

    config = MicroBatchIterator.Config(join_timeout_s=0.2)
    mode = sys.argv[1]
    if mode == "normal":
        it = MicroBatchIterator(source(), config, device="cpu")
        next(it)
    elif mode == "exception-in-with":
        with MicroBatchIterator(source(), config, device="cpu") as it:
            next(it)
            raise RuntimeError("the training step failed")
    elif mode == "keyboard-interrupt":
        it = MicroBatchIterator(source(), config, device="cpu")
        next(it)
        raise KeyboardInterrupt
    elif mode == "sys-exit-in-with":
        with MicroBatchIterator(source(), config, device="cpu") as it:
            next(it)
            sys.exit(3)
    """
)
_EXPECTED = {
    "normal": 0,
    "exception-in-with": 1,
    "keyboard-interrupt": -signal.SIGINT,
    "sys-exit-in-with": 3,
}
REPEATS = 2


@pytest.mark.slow
def test_exit_status_is_the_training_loops_while_the_source_runs_torch():
    """Whatever the prefetch thread is doing inside a torch-running source when the process ends
    (normally, by an exception or SystemExit through ``with``, or an uncaught KeyboardInterrupt),
    the process exits with the training loop's own status, never SIGABRT; repeated, since the
    abort depends on where the thread is when finalization starts."""
    runs = [
        (mode, subprocess.Popen([sys.executable, "-c", _SCRIPT, mode], stderr=subprocess.PIPE))
        for mode in _EXPECTED
        for _ in range(REPEATS)
    ]
    failures = []
    for mode, process in runs:
        _, stderr = process.communicate(timeout=240)
        if process.returncode != _EXPECTED[mode]:
            failures.append((mode, process.returncode, stderr.decode()[-500:]))
    assert failures == []
