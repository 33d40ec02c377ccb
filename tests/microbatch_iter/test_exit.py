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

    config = MicroBatchIterator.Config(join_timeout_s=20)
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
    runs = [
        (
            mode,
            subprocess.Popen(
                [sys.executable, "-c", _HOST_SCRIPT, mode],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            ),
        )
        for mode in _HOST_EXPECTED
        for _ in range(REPEATS)
    ]
    failures = []
    for mode, process in runs:
        stdout, stderr = process.communicate(timeout=240)
        ran = b"HOST-HANDLER-RAN" in stdout
        if process.returncode != _HOST_EXPECTED[mode] or not ran:
            failures.append((mode, process.returncode, ran, stderr.decode()[-500:]))
    assert failures == []
