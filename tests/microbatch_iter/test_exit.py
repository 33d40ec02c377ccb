"""Process exit while the prefetch thread runs torch inside the source: the loop's own status."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

_FORK_PER_MODE = textwrap.dedent(
    """
    def fork_per_mode():
        # One process imports torch and knitkit once, then forks a child per mode in argv: each
        # child runs its mode and exits through the interpreter's own finalization (the path under
        # test), its output in a file; the parent reports every child's exit status as JSON.
        import json, os, tempfile
        children = []
        for mode in sys.argv[1:]:
            out = tempfile.TemporaryFile()
            pid = os.fork()
            if pid == 0:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                return mode
            children.append((mode, pid, out))
        results = []
        for mode, pid, out in children:
            _, status = os.waitpid(pid, 0)
            out.seek(0)
            output = out.read().decode(errors="replace")
            code = os.waitstatus_to_exitcode(status)
            results.append({"mode": mode, "code": code, "output": output[-2000:]})
        print(json.dumps(results), flush=True)
        os._exit(0)  # the parent's own exit is not under test
    """
)


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
    mode = fork_per_mode()
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


def _exits(script: str, expected: dict[str, int]) -> list[dict[str, Any]]:
    """Every mode of ``expected`` run ``REPEATS`` times by ``script``, each in a child forked from
    one process that imported torch and knitkit once (``_FORK_PER_MODE``): their exit statuses
    (negative: the signal) and outputs."""
    modes = [mode for mode in expected for _ in range(REPEATS)]
    done = subprocess.run(
        [sys.executable, "-c", "import sys\n" + _FORK_PER_MODE + script, *modes],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads(done.stdout.splitlines()[-1])
    assert sorted(r["mode"] for r in runs) == sorted(modes), runs
    return runs


@pytest.mark.slow
def test_exit_status_is_the_training_loops_while_the_source_runs_torch():
    """Whatever the prefetch thread is doing inside a torch-running source when the process ends
    (normally, by an exception or SystemExit through ``with``, or an uncaught KeyboardInterrupt),
    the process exits with the training loop's own status, never SIGABRT; repeated, since the
    abort depends on where the thread is when finalization starts."""
    failures = [
        (run["mode"], run["code"], run["output"][-500:])
        for run in _exits(_SCRIPT, _EXPECTED)
        if run["code"] != _EXPECTED[run["mode"]]
    ]
    assert failures == []


_HOST_SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    atexit.register(print, "HOST-HANDLER-RAN", flush=True)  # the trainer's, before knitkit
    import torch
    from knitkit.microbatch_iter import MicroBatchIterator
    torch.set_num_threads(1)

    def source():  # a torch-based collate: the thread spends its time inside torch ops
        yield {"x": torch.zeros(2)}
        while True:
            a = torch.randn(128, 128)
            for _ in range(1_000_000):
                a = torch.tanh(a @ a)
            yield {"x": a}

    def waiting_consumer():  # a ring consumer waiting for a micro-batch nobody publishes
        from knitkit.storage.delivery.consumer import MicroBatchConsumer
        from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
        spec = RingSpec.new(num_slots=2, slot_bytes=1 << 16, num_consumers=1)
        owner = SlotRing.create(spec)
        atexit.register(owner.unlink)
        return MicroBatchConsumer(spec, 0, startup_timeout_s=600, wait_timeout_s=600)

    config = MicroBatchIterator.Config(join_timeout_s=5)  # generous: SourceAbandoned lands in ms
    mode = fork_per_mode()
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
    elif mode == "sys-exit":
        it = MicroBatchIterator(source(), config, device="cpu")
        next(it)
        sys.exit(3)
    elif mode == "consumer-wait":
        it = MicroBatchIterator(waiting_consumer(), config, device="cpu")
        import time; time.sleep(0.2)
    """
)
_HOST_EXPECTED = {
    "normal": 0,
    "exception-in-with": 1,
    "keyboard-interrupt": -signal.SIGINT,
    "sys-exit": 3,
    "consumer-wait": 0,
}


@pytest.mark.slow
def test_the_hosts_earlier_atexit_handlers_run_and_the_status_is_the_loops():
    """A guest's exit: with a prefetch thread inside a torch-running source (or waiting in a ring
    consumer) at exit, an atexit handler the trainer registered BEFORE importing knitkit still
    runs, the status is the loop's (0, 1, SIGINT, a SystemExit's code, also outside any
    iterator's ``with``) and never SIGABRT; the threads are ended, not the process (NOTE [ Exit
    with a thread inside the source ]). Repeated: the abort depends on timing."""
    failures = [
        (run["mode"], run["code"], ran, run["output"][-500:])
        for run in _exits(_HOST_SCRIPT, _HOST_EXPECTED)
        if run["code"] != _HOST_EXPECTED[run["mode"]]
        or not (ran := "HOST-HANDLER-RAN" in run["output"])
    ]
    assert failures == []
