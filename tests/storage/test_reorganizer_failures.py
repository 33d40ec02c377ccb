"""Reorganizer failures: consumers raise in time, and no process or /dev/shm segment is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from delivery_payloads import fill_backend, make_metas, plan_for

from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.consumer import (
    MicroBatchConsumer,
    ReorganizerDiedError,
    ReorganizerError,
)
from knitkit.storage.delivery.liveness import pid_alive
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingSpec
from knitkit.storage.planning.plan import Topology
from knitkit.types import UnitKey

LIVENESS_S = 2.0


def _segments(*names: str) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if any(n in f for n in names)]


@pytest.fixture
def loaded():
    """A shared-memory store with 8 trajectories and a DP1 x CP1 x TP2 plan of 4+ micro-batches."""
    metas = make_metas(np.full(8, 120).tolist())
    backend = SharedMemoryBackend(slab_bytes=2 << 20)
    fill_backend(backend, metas)
    plan = plan_for(metas, Topology(dp=1, cp=1, tp=2), 240, "mb0")
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 18, num_consumers=2)
    yield backend, plan.consumer(0, 0), spec
    backend.close()
    assert _segments(spec.name) == []


def test_killed_reorganizer_is_detected_and_cleaned(loaded):
    """SIGKILL mid-mini-batch: both TP consumers raise within the liveness timeout; close() then
    leaves no reorganizer process and no ring segment."""
    backend, group, spec = loaded
    with ReorganizerProcess(backend, spec) as reorganizer:
        reorganizer.submit("mb0", group)
        consumers = [MicroBatchConsumer(spec, r, liveness_timeout_s=LIVENESS_S) for r in range(2)]
        first = [c.next_micro_batch(timeout_s=60) for c in consumers]
        assert first[0].layout.extra["micro_batch"] == 0
        # Delivered before the mini-batch is materialized: with one slot held, the reorganizer
        # has published one micro-batch and read only its bytes.
        assert reorganizer.ring.published == 1 < len(group.micro_batches)
        assert (
            0
            < reorganizer.bytes_read
            < sum(backend.spec(r.key).nbytes for r in group.reads() if r.key.field != "reward")
        )
        assert reorganizer.pid is not None
        os.kill(reorganizer.pid, signal.SIGKILL)
        for batch in first:
            batch.release()  # frees the single slot; the dead reorganizer will not refill it
        for consumer in consumers:
            start = time.monotonic()
            with pytest.raises(ReorganizerDiedError, match="died"):
                consumer.next_micro_batch()
            assert time.monotonic() - start < LIVENESS_S
            consumer.close()
        pid = reorganizer.pid
    assert not pid_alive(pid)
    assert _segments(spec.name) == []


def test_early_close_makes_consumers_raise(loaded):
    """Closing the reorganizer before its mini-batch is consumed stops it (it is blocked on a full
    ring); consumers raise instead of waiting, and the ring is unlinked."""
    backend, group, spec = loaded
    reorganizer = ReorganizerProcess(backend, spec)
    reorganizer.submit("mb0", group)
    consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=LIVENESS_S)
    consumer.next_micro_batch(timeout_s=60).release()
    reorganizer.close()
    assert _segments(spec.name) == []
    with pytest.raises((ReorganizerError, ReorganizerDiedError)):
        for _ in range(len(group.micro_batches)):
            consumer.next_micro_batch(timeout_s=LIVENESS_S * 2).release()
    consumer.close()
    assert reorganizer.pid is not None and not pid_alive(reorganizer.pid)


def test_reorganizer_error_reaches_consumers(loaded):
    """A read error in the reorganizer (a unit deleted after planning) reaches every consumer as
    ReorganizerError naming the missing unit."""
    backend, group, spec = loaded
    victim = group.micro_batches[-1].sequences[0].trajectory_id
    backend.delete(UnitKey(victim, "routing"))
    with ReorganizerProcess(backend, spec) as reorganizer:
        reorganizer.submit("mb0", group)
        reorganizer.finish(timeout_s=0)
        first, second = MicroBatchConsumer(spec, 0), MicroBatchConsumer(spec, 1)
        with pytest.raises(ReorganizerError, match=f"{victim}/routing"):
            for _ in range(len(group.micro_batches)):
                a, b = first.next_micro_batch(timeout_s=30), second.next_micro_batch(timeout_s=30)
                assert a.layout == b.layout
                a.release()
                b.release()
        first.close()
        second.close()


_OWNER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    sys.path.insert(0, {tests!r})
    from delivery_payloads import fill_backend, make_metas, plan_for
    from knitkit.storage.planning.plan import Topology
    from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
    from knitkit.storage.backends.shm import SharedMemoryBackend
    from knitkit.storage.delivery.slot_ring import RingSpec

    metas = make_metas(np.full(8, 120).tolist())
    backend = SharedMemoryBackend(slab_bytes=2 << 20)
    fill_backend(backend, metas)
    plan = plan_for(metas, Topology(dp=1, cp=1, tp=1), 240, "mb0")
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 18, num_consumers=1)
    try:
        with ReorganizerProcess(backend, spec) as reorganizer:
            reorganizer.submit("mb0", plan.consumer(0, 0))
            print(spec.name, reorganizer.pid, *backend.paths, flush=True)
            time.sleep(120)
    finally:
        backend.close()
    """
)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_owner_interrupt_unlinks_everything(signum):
    """SIGINT or SIGTERM to the owning process while its reorganizer is blocked on a full ring:
    the owner exits, the reorganizer process is gone and /dev/shm holds nothing of theirs."""
    script = _OWNER.format(tests=str(Path(__file__).parent))
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        ring_name, child_pid, *slabs = owner.stdout.readline().split()
        assert _segments(ring_name)
        time.sleep(0.5)  # let the reorganizer fill the ring and block
        owner.send_signal(signum)
        owner.wait(timeout=30)
    finally:
        if owner.poll() is None:
            owner.kill()
    deadline = time.monotonic() + 10
    while pid_alive(int(child_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(int(child_pid))
    assert _segments(ring_name) == []
    assert [p for p in slabs if os.path.exists(p)] == []
