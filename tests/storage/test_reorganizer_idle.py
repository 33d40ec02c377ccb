"""A waiting reorganizer process costs little: one wake per heartbeat period, paced to its
consumers' liveness timeout, and none for its launcher's death or stop (NOTE [ Reorganizer
process shutdown ], NOTE [ Heartbeat period ])."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from delivery_payloads import fill_backend, make_metas, plan_for
from ring_parts import until_producer_waits
from task_switches import total_voluntary_switches

from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import MAX_HEARTBEAT_S, heartbeat_period, idle_period
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import HEARTBEAT_S, STARTING, RingSpec, SlotRing
from knitkit.storage.planning.plan import Topology

LIVENESS_S = 1.0
PACED_LIVENESS_S = 30.0
"""The consumers' default timeout: their producer beats once per MAX_HEARTBEAT_S."""
LAUNCHER_LIVENESS_S = 24.0
"""A 3 s idle period: a child that left only at its next timed wake would leave 3 s after its
launcher, a child that leaves at once well within half of it on a loaded machine (0.71 s seen at
load 28-30, against the 0.5 s bound of a 1 s period)."""
WAIT_S = 120.0
"""Bound of every wait on another process's start-up: generous, for a loaded machine."""


def _wakes(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid`` so far (one per blocking wait)."""
    return total_voluntary_switches(f"/proc/{pid}/task/*/status")


def _started(reorganizer: ReorganizerProcess) -> int:
    """The child's pid once it runs (its start-up imports: polled, not a fixed wait)."""
    deadline = time.monotonic() + WAIT_S
    while reorganizer.ring.state == STARTING and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reorganizer.pid is not None and reorganizer.ring.state != STARTING
    return reorganizer.pid


def test_an_idle_reorganizer_wakes_once_per_heartbeat_period() -> None:
    """A reorganizer process waiting for its next assignment wakes once per heartbeat period,
    for its owner check and its beat together (a heartbeat thread beside a 0.2 s poll woke it
    9 times a second, ~0.1 ms of CPU each, on every idle reorganizer of a job), and its
    heartbeat keeps a waiting consumer's liveness check content: the consumer's bounded wait
    ends in TimeoutError, not ReorganizerDiedError."""
    backend = SharedMemoryBackend(slab_bytes=1 << 16)
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 12, num_consumers=1)
    try:
        with ReorganizerProcess(backend, spec) as reorganizer:
            pid = _started(reorganizer)
            with MicroBatchConsumer(spec, 0, liveness_timeout_s=LIVENESS_S) as consumer:
                before, start = _wakes(pid), time.monotonic()
                with pytest.raises(TimeoutError):
                    consumer.next_micro_batch(timeout_s=1.2 * LIVENESS_S)
                wakes, elapsed = _wakes(pid) - before, time.monotonic() - start
        assert wakes <= elapsed / HEARTBEAT_S + 3, f"{wakes} wakes in {elapsed:.2f} s idle"
    finally:
        backend.close()


def test_an_idle_paced_host_beats_once_per_liveness_eighth_without_the_full_ring_cap() -> None:
    """Told its consumers' 30 s timeout, a host beats every 2 s while it waits on a full ring
    (MAX_HEARTBEAT_S: a consumer that died holding a slot is seen within 2 s) but only every
    3.75 s while idle, the period a ``ReorganizerProcess``'s child polls its assignment pipe
    with (NOTE [ Heartbeat period ]): that wait sees its launcher's death and stop at once. On
    1cebb89 the idle wait kept the 2 s cap (transfer.py's encoder reorganizers idle most of a
    step)."""
    from knitkit.storage.delivery.reorganizer import ReorganizerHost

    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 12, num_consumers=1)
    backend = SharedMemoryBackend(slab_bytes=1 << 16)
    try:
        host = ReorganizerHost(
            backend, spec, owns_ring=True, beat_thread=False, liveness_timeout_s=PACED_LIVENESS_S
        )
        try:
            assert host.heartbeat_s == MAX_HEARTBEAT_S
            assert host.idle_s == PACED_LIVENESS_S / 8 > MAX_HEARTBEAT_S
        finally:
            host.close()
        host = ReorganizerHost(backend, spec, owns_ring=True, beat_thread=False)
        try:
            assert host.idle_s == host.heartbeat_s == HEARTBEAT_S  # not told: 4 beats a second
        finally:
            host.close()
    finally:
        backend.close()


def test_a_paced_reorganizer_wakes_once_per_period_idle_and_on_a_full_ring() -> None:
    """Told its consumers' liveness timeout (30 s), a reorganizer process beats once per
    MAX_HEARTBEAT_S instead of 4 times a second: idle it wakes at most once per period, blocked
    on a full ring (its one slot held by a consumer) once per period plus the release, and both
    consumers stay content (no ReorganizerDiedError). close(), right after one of the idle
    child's beats, then stops it at once (its stop item wakes it): it exits by itself, code 0,
    within a join timeout of half its idle period, rather than being terminated (a child woken
    only by its next timed wake would take a whole period; 1.1 s seen at load 28-30 against the
    earlier 1 s bound of an unaligned stop)."""
    assert heartbeat_period(PACED_LIVENESS_S) == MAX_HEARTBEAT_S
    metas = make_metas(np.full(4, 120).tolist())
    backend = SharedMemoryBackend(slab_bytes=2 << 20)
    fill_backend(backend, metas)
    group = plan_for(metas, Topology(dp=1, cp=1, tp=1), 240, "mb0").consumer(0, 0)
    assert len(group.micro_batches) >= 2
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 18, num_consumers=1)
    window_s = MAX_HEARTBEAT_S / 2  # the old 4 wakes a second make 4 here, the bound 3
    try:
        reorganizer = ReorganizerProcess(
            backend,
            spec,
            join_timeout_s=0.5 * idle_period(PACED_LIVENESS_S),
            liveness_timeout_s=PACED_LIVENESS_S,
        )
        with reorganizer:
            pid = _started(reorganizer)
            with MicroBatchConsumer(spec, 0, liveness_timeout_s=PACED_LIVENESS_S) as consumer:
                before, start = _wakes(pid), time.monotonic()
                with pytest.raises(TimeoutError):  # idle: nothing submitted
                    consumer.next_micro_batch(timeout_s=window_s)
                idle, idle_s = _wakes(pid) - before, time.monotonic() - start
                reorganizer.submit("mb0", group)
                held = consumer.next_micro_batch(timeout_s=WAIT_S)  # the ring's only slot
                until_producer_waits(reorganizer.ring, WAIT_S)  # blocked on the full ring
                before, start = _wakes(pid), time.monotonic()
                time.sleep(window_s)  # the producer waits for the held slot all along
                full, full_s = _wakes(pid) - before, time.monotonic() - start
                held.release()
                for _ in range(len(group.micro_batches) - 1):
                    consumer.next_micro_batch(timeout_s=WAIT_S).release()
                _until_beat(reorganizer.ring)  # its idle wait starts a whole period now
            stop = time.monotonic()
        stopped_s = time.monotonic() - stop
        assert idle <= idle_s / MAX_HEARTBEAT_S + 2, f"{idle} wakes in {idle_s:.2f} s idle"
        assert full <= full_s / MAX_HEARTBEAT_S + 2, (
            f"{full} wakes in {full_s:.2f} s on a full ring"
        )
        assert reorganizer._process.exitcode == 0, reorganizer._process.exitcode
        assert stopped_s < reorganizer.join_timeout_s, stopped_s
    finally:
        backend.close()


def _until_beat(ring: SlotRing) -> None:
    """Return once the producer of ``ring`` beats next (its wait restarts its period)."""
    beat, deadline = ring.heartbeat, time.monotonic() + WAIT_S
    while ring.heartbeat == beat:
        assert time.monotonic() < deadline, "the idle reorganizer never beat"
        time.sleep(0.01)


_LAUNCHER = textwrap.dedent(
    """
    import sys
    from knitkit.storage.backends.shm import SharedMemoryBackend
    from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
    from knitkit.storage.delivery.slot_ring import RingSpec

    if __name__ == "__main__":
        backend = SharedMemoryBackend(slab_bytes=1 << 16, directory={directory!r})
        spec = RingSpec.new(num_slots=1, slot_bytes=1 << 12, num_consumers=1)
        reorganizer = ReorganizerProcess(backend, spec, liveness_timeout_s={liveness})
        while reorganizer.ring.state == 0:  # STARTING
            pass
        print(reorganizer.pid, spec.name, flush=True)
        sys.stdin.read()  # hold the reorganizer until killed
    """
)


def test_an_idle_reorganizer_leaves_as_its_launcher_dies(tmp_path, shm_dir: str) -> None:
    """The launcher of an idle reorganizer paced to a 3 s idle period is SIGKILLed right after
    one of the child's timed wakes (its heartbeat moved): the child leaves at once, as its
    assignment pipe ends, not at its next timed wake a whole period later (the pacing keeps
    that promise of NOTE [ Reorganizer process shutdown ]). The store's files go with the
    private directory; the ring with the launcher's resource tracker."""
    script = tmp_path / "launcher.py"
    period_s = idle_period(LAUNCHER_LIVENESS_S)
    script.write_text(_LAUNCHER.format(liveness=LAUNCHER_LIVENESS_S, directory=shm_dir))
    launcher = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    ring: SlotRing | None = None
    try:
        assert launcher.stdout is not None
        ready, _, _ = select.select([launcher.stdout], [], [], WAIT_S)
        assert ready, "the launcher printed no reorganizer pid"
        pid, name = launcher.stdout.readline().split()
        ring = SlotRing.attach(RingSpec(name, num_slots=1, slot_bytes=1 << 12, num_consumers=1))
        child = os.pidfd_open(int(pid))
        try:
            _until_beat(ring)  # the child's next timed wake (within a period)
            launcher.kill()
            killed = time.monotonic()
            exited, _, _ = select.select([child], [], [], WAIT_S)
            left_s = time.monotonic() - killed
        finally:
            os.close(child)
        assert exited, "the reorganizer outlived its launcher"
        assert left_s < period_s / 2, f"it left {left_s:.2f} s after its launcher died"
    finally:
        if ring is not None:
            ring.close()
        launcher.kill()
        launcher.wait(WAIT_S)
