"""A fork of the launcher leaves its reorganizer alone: clean-ups run only in the owning process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

WAIT_S = 240.0
"""Bound of the whole scenario (spawned reorganizer, fork, 12 micro-batches): generous."""

_SCENARIO = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from delivery_payloads import fill_backend, make_metas, plan_for, real_tokens
    from knitkit.storage import MicroBatchConsumer, ReorganizerProcess, RingSpec, SharedMemoryBackend
    from knitkit.storage.planning import Topology

    def use_inherited(reorganizer):
        reorganizer.close()  # a no-op here: the launcher owns the ring and the process
        try:
            reorganizer.submit("mb1", None)
        except RuntimeError as error:
            assert "forked copy" in str(error), error
        else:
            raise AssertionError("a forked copy could submit to its parent's reorganizer")

    def main(how):
        metas = make_metas([100] * 12)
        backend = SharedMemoryBackend(slab_bytes=2 << 20)
        fill_backend(backend, metas)
        plan = plan_for(metas, Topology(dp=1, cp=1, tp=1), 100, "mb0").consumer(0, 0)
        assert len(plan.micro_batches) == 12
        spec = RingSpec.new(num_slots=1, slot_bytes=1 << 18, num_consumers=1)
        seen = []
        with ReorganizerProcess(backend, spec) as reorganizer, MicroBatchConsumer(spec, 0) as consumer:
            reorganizer.submit("mb0", plan)
            batch = consumer.next_micro_batch(timeout_s=60)
            seen.append(real_tokens(batch.fields))
            batch.release()
            if how == "os.fork":
                pid = os.fork()
                if pid == 0:
                    sys.exit(0)  # unwinds both `with` blocks here, then runs the exit hooks
                status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            else:
                child = mp.get_context("fork").Process(target=use_inherited, args=(reorganizer,))
                child.start()
                child.join(60)
                status = child.exitcode
            for _ in range(11):
                batch = consumer.next_micro_batch(timeout_s=60)
                seen.append(real_tokens(batch.fields))
                batch.release()
            assert status == 0, ("the forked child exited with", status)
        tokens = np.sort(np.concatenate(seen))
        expected = np.sort(np.concatenate([(i << 20) + np.arange(100) for i in range(12)]))
        assert np.array_equal(tokens, expected)
        print("DELIVERED", len(seen), spec.name, flush=True)
        backend.close()

    if __name__ == "__main__":
        main(sys.argv[1])
    """
)


@pytest.mark.parametrize("how", ["os.fork", "fork-context"])
def test_a_fork_of_the_launcher_does_not_stop_its_reorganizer(how, tmp_path):
    """A launcher forks while its reorganizer is mid-mini-batch (12 micro-batches, one slot):
    a child that exits normally through the launcher's ``with`` blocks (``os.fork``), or that
    closes the inherited reorganizer (a ``multiprocessing`` fork-context worker), leaves the
    launcher's ring and reorganizer process running: every micro-batch reaches the launcher's
    consumer, each token once, and the launcher's own close still removes the ring."""
    script = tmp_path / "scenario.py"
    script.write_text(_SCENARIO.format(tests=str(Path(__file__).parent)))
    done = subprocess.run(
        [sys.executable, str(script), how], capture_output=True, text=True, timeout=WAIT_S
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("DELIVERED")]
    assert done.returncode == 0 and lines, f"{done.stdout}\n{done.stderr[-4000:]}"
    _, count, ring = lines[-1].split()
    assert count == "12"
    assert not os.path.exists(f"/dev/shm/{ring}")
