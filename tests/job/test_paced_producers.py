"""A job's waiting producers are paced to its ranks' liveness timeout (NOTE [ Heartbeat period ]
in knitkit/storage/delivery/publication.py): the driver's reorganizer processes and its
schedule writer's heartbeat wake once per paced period (2 s at the default 30 s timeout), not
4 times a second as they did while the job left the pacing to the producers' own default."""

from __future__ import annotations

import threading
import time

from job_harness import controller, driver_config, trajectories, wait_for
from task_switches import total_voluntary_switches

from knitkit.storage.delivery.publication import MAX_HEARTBEAT_S, heartbeat_period
from knitkit.storage.delivery.slot_ring import STARTING

LIVENESS_S = 30.0
"""The job's default: its producers beat once per MAX_HEARTBEAT_S."""
WINDOW_S = MAX_HEARTBEAT_S / 2
"""Idle time watched: 4 wakes a second make 4 here; a paced producer at most one."""


def test_a_jobs_idle_producers_wake_once_per_paced_period() -> None:
    assert heartbeat_period(LIVENESS_S) == MAX_HEARTBEAT_S
    data = trajectories(4, 2, seed=1)
    config = driver_config(1, 1, 1, 1, liveness_timeout_s=LIVENESS_S)
    with config.build(admission=controller(data, 2)) as driver:
        members = driver.pool._members  # the ProcessPool's ReorganizerProcess per group
        wait_for(
            lambda: all(m.ring.state != STARTING for m in members.values()),
            what="every reorganizer started",
        )
        beats = [t for t in threading.enumerate() if t.name == "knitkit-publisher-heartbeat"]
        assert beats, "the driver's schedule writer runs no heartbeat thread"
        tasks = [f"/proc/{m.pid}/task/*/status" for m in members.values()]
        tasks += [f"/proc/self/task/{t.native_id}/status" for t in beats]
        before, start = [total_voluntary_switches(p) for p in tasks], time.monotonic()
        time.sleep(WINDOW_S)  # the window watched, not a wait for an event
        wakes = [total_voluntary_switches(p) - b for p, b in zip(tasks, before, strict=True)]
        elapsed = time.monotonic() - start
    bound = elapsed / MAX_HEARTBEAT_S + 2
    assert all(w <= bound for w in wakes), f"wakes {wakes} in {elapsed:.2f} s idle (bound {bound})"
