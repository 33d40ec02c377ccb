"""Reorganizer failures: consumers raise in time, and no process or /dev/shm segment is left."""

from __future__ import annotations

import inspect
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from delivery_payloads import fill_backend, make_metas, plan_for
from stalling_backend import StallingBackend

from knitkit.storage.backends.segments import pid_alive
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.consumer import (
    MicroBatchConsumer,
    ReorganizerDiedError,
    ReorganizerError,
)
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.storage.planning.plan import Topology
from knitkit.types import UnitKey

LIVENESS_S = 2.0
WAIT_S = 120.0
"""Bound of every wait on another process: generous, so a loaded machine passes too."""


def _segments(*names: str) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if any(n in f for n in names)]


def _poll(condition: Callable[[], bool], timeout_s: float) -> bool:
    """True as soon as ``condition()`` holds; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


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
    import signal, sys, time
    import numpy as np
    # A suite run in the background of a non-interactive shell inherits SIGINT ignored; a user's
    # owner process gets Python's default handler, so this one does too.
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
        # The reorganizer has filled the ring (its one slot) and blocks: poll, never a fixed sleep.
        ring = SlotRing.attach(
            RingSpec(ring_name, num_slots=1, slot_bytes=1 << 18, num_consumers=1)
        )
        try:
            assert _poll(lambda: ring.published >= 1, WAIT_S)
        finally:
            ring.close()
        owner.send_signal(signum)
        owner.wait(timeout=WAIT_S)
    finally:
        if owner.poll() is None:
            owner.kill()
    assert _poll(lambda: not pid_alive(int(child_pid)), WAIT_S)
    assert not pid_alive(int(child_pid))
    assert _segments(ring_name) == []
    assert [p for p in slabs if os.path.exists(p)] == []


def test_stuck_read_is_reported_by_liveness(loaded):
    """Liveness measures progress: a reorganizer whose read blocks forever (its process alive,
    its threads running) is reported to every consumer as ReorganizerDiedError within the
    liveness timeout, instead of a wait that only a caller's timeout ends."""
    backend, group, spec = loaded
    victim = group.micro_batches[1].sequences[0].trajectory_id
    stalling = StallingBackend(backend, UnitKey(victim, "tokens"))
    with ReorganizerProcess(stalling, spec, join_timeout_s=1.0) as reorganizer:
        reorganizer.submit("mb0", group)
        consumers = [MicroBatchConsumer(spec, r, liveness_timeout_s=LIVENESS_S) for r in range(2)]
        for consumer in consumers:
            consumer.next_micro_batch(timeout_s=WAIT_S).release()
        for consumer in consumers:
            start = time.monotonic()
            with pytest.raises(ReorganizerDiedError, match="no progress"):
                consumer.next_micro_batch(timeout_s=WAIT_S)
            assert time.monotonic() - start < WAIT_S / 2
            consumer.close()
        assert reorganizer.pid is not None and pid_alive(reorganizer.pid)


def test_stopped_reorganizer_is_reported_by_liveness(loaded):
    """A SIGSTOPped reorganizer (alive, making no progress) is reported within the liveness
    timeout; close() then still ends it and unlinks its ring."""
    backend, group, spec = loaded
    with ReorganizerProcess(backend, spec, join_timeout_s=1.0) as reorganizer:
        reorganizer.submit("mb0", group)
        consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=LIVENESS_S)
        consumer.next_micro_batch(timeout_s=WAIT_S)
        assert reorganizer.pid is not None
        os.kill(reorganizer.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ReorganizerDiedError, match="no progress"):
                consumer.next_micro_batch(timeout_s=WAIT_S)
        finally:
            os.kill(reorganizer.pid, signal.SIGCONT)
        consumer.close()
    assert _segments(spec.name) == []


_CONSUMER = textwrap.dedent(
    """
    import sys
    from knitkit.storage.delivery.consumer import MicroBatchConsumer
    from knitkit.storage.delivery.slot_ring import RingSpec
    spec = RingSpec({name!r}, num_slots=1, slot_bytes={slot_bytes}, num_consumers=2)
    consumer = MicroBatchConsumer(spec, 1)
    batch = consumer.next_micro_batch(timeout_s=120)
    print(batch.layout.extra["micro_batch"], flush=True)
    sys.stdin.read()  # hold the slot until killed
    """
)


def test_consumer_killed_holding_a_slot_is_reported_to_peers_and_reorganizer(loaded):
    """A TP consumer SIGKILLed while it holds the ring's only slot: its reorganizer detects the
    dead pid, stops with an error naming that consumer, and the other TP rank raises
    ReorganizerError with that message instead of waiting forever."""
    backend, group, spec = loaded
    with ReorganizerProcess(backend, spec) as reorganizer:
        reorganizer.submit("mb0", group)
        script = _CONSUMER.format(name=spec.name, slot_bytes=spec.slot_bytes)
        peer = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert peer.stdout is not None and peer.stdout.readline().strip() == "0"
            peer.kill()
            peer.wait(timeout=WAIT_S)
        finally:
            if peer.poll() is None:
                peer.kill()
        with MicroBatchConsumer(spec, 0, liveness_timeout_s=WAIT_S) as consumer:
            consumer.next_micro_batch(timeout_s=WAIT_S).release()
            with pytest.raises(ReorganizerError, match=rf"consumer 1 \(pid {peer.pid}\).*died"):
                consumer.next_micro_batch(timeout_s=WAIT_S)
        assert "consumer 1" in reorganizer.ring.error()
        assert reorganizer.finish(timeout_s=WAIT_S)  # the reorganizer stopped on its own


def test_waits_are_bounded_by_default(loaded):
    """No public wait is unbounded by default: a consumer of a live producer that publishes
    nothing raises TimeoutError after its wait_timeout_s, and the default bound is finite."""
    _, _, spec = loaded
    assert inspect.signature(MicroBatchConsumer).parameters["wait_timeout_s"].default < math.inf
    assert inspect.signature(ReorganizerProcess.finish).parameters["timeout_s"].default < math.inf
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    try:
        with (
            MicroBatchConsumer(spec, 0, wait_timeout_s=0.5) as consumer,
            pytest.raises(TimeoutError, match="micro-batch 0"),
        ):
            consumer.next_micro_batch()
    finally:
        publisher.close()
        owner.close()
        owner.unlink()


def test_one_attachment_per_consumer_index(loaded):
    """Two live processes cannot attach as the same TP consumer index (they would release each
    other's slots): the second attach raises naming the index and the holder's pid."""
    _, _, spec = loaded
    owner = SlotRing.create(spec)
    holder = subprocess.Popen(
        [sys.executable, "-c", _CONSUMER.format(name=spec.name, slot_bytes=spec.slot_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert _poll(lambda: owner.consumer_pid(1) == holder.pid, WAIT_S)
        with pytest.raises(ValueError, match=rf"consumer_index=1 .* pid {holder.pid}"):
            MicroBatchConsumer(spec, 1)
    finally:
        holder.kill()
        holder.wait(timeout=WAIT_S)
        owner.close()
        owner.unlink()
