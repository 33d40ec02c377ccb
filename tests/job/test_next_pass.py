"""A group's next pass starts once its own inputs are produced; the driver's failure reaches a rank waiting on its data ring."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

from job_harness import (
    Hold,
    Seen,
    assert_trained_once,
    controller,
    driver_config,
    grid,
    join,
    rank_loop,
    serve_held_job,
    trajectories,
    wait_for,
)

from knitkit.job import ProcessPool, RankCoords, RankSpec


def _ranks(
    spec: RankSpec, coords: list[RankCoords], holds: dict[int, Hold]
) -> tuple[list[threading.Thread], list[Seen], list[float]]:
    """Each rank in a thread, rank ``r`` held by ``holds[r]``; ``ended[r]``: when it returned."""
    seen = [Seen(c) for c in coords]
    ended = [0.0] * len(coords)

    def run(i: int) -> None:
        seen[i] = rank_loop(spec, coords[i], hold=holds.get(coords[i].rank))
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(coords))]
    for thread in threads:
        thread.start()
    return threads, seen, ended


def test_a_group_trains_while_another_group_still_holds_back_its_write_backs() -> None:
    """DP2 x CP2, dp0/cp1 held at the start of mini-batch 0's forward-only pass (none of its
    outputs exist): both dp1 groups get their train pass and finish it (they read only their
    own trajectories' outputs), while the train pass is not served to dp0/cp0 either: a
    trajectory's tokens are split over its DP rank's CP groups, so readiness is per trajectory,
    not per group. Once released, every rank reads the outputs bit for bit and every token is
    consumed exactly once per pass."""
    data = trajectories(4, 2, seed=32)
    hold = Hold("tb0-mb0", "old")
    with driver_config(2, 2, 1, 1).build(admission=controller(data, 2)) as driver:
        coords = grid(2, 2, 1, 1)
        threads, seen, _ = _ranks(driver.rank_spec(), coords, {1: hold})
        for trajectory in data:
            driver.write(trajectory)
        driver.finish()
        assert hold.reached.wait(60)
        dp1 = ("backbone/dp1/cp0", "backbone/dp1/cp1")
        wait_for(lambda: driver.consumers("tb0-mb0", "train") == dp1, 30)
        assert driver.ledger("tb0-mb0").passes["train"].submitted == set(dp1)
        waits = "tb0-mb0/train waits for old_lp from ['backbone/dp0/cp1']"
        wait_for(lambda: waits in driver.progress().blocked, 30, waits)  # dp0/cp0's own are in
        assert driver.progress().served == {"old": 1, "train": 0}, driver.progress()
        assert not driver.produced("tb0-mb0", "old_lp")
        hold.release.set()
        driver.drain(120)
        join(threads)
    assert [s.error for s in seen if s.error] == []
    assert [m for s in seen for m in s.mismatches] == []
    assert_trained_once([], [], seen, data)


def test_the_driver_failing_reaches_a_rank_waiting_on_its_data_ring() -> None:
    """CP2: dp0/cp1 is held before it writes back, so dp0/cp0 enters its train pass and waits
    on its data ring (its inputs lack cp1's pieces); the driver then fails (dp0/cp1's
    reorganizer killed): the waiting rank, whose own reorganizer lives, raises
    ``DriverFailedError`` carrying the driver's error within a second of the failure, not
    after its wait's own bound."""
    data = trajectories(2, 2, seed=33)
    entered = Hold("tb0-mb0", "train")
    entered.release.set()  # a marker: the rank goes on at once
    held = Hold("tb0-mb0", "old")
    with driver_config(1, 2, 1, 1).build(admission=controller(data, 1)) as driver:
        coords = grid(1, 2, 1, 1)
        threads, seen, ended = _ranks(driver.rank_spec(), coords, {0: entered, 1: held})
        for trajectory in data:
            driver.write(trajectory)
        assert entered.reached.wait(30), "rank 0 never started its train pass"
        assert isinstance(driver.pool, ProcessPool)
        os.kill(driver.pool.pids()["backbone/dp0/cp1"] or 0, signal.SIGKILL)
        wait_for(lambda: driver.failure is not None, 30, "the driver's failure")
        failed = time.monotonic()
        threads[0].join(10)
        assert seen[0].error.startswith("DriverFailedError"), seen[0].error
        assert "the driver failed" in seen[0].error and "backbone/dp0/cp1" in seen[0].error
        assert ended[0] - failed < 1.0, ended[0] - failed
        held.release.set()
        join(threads)
    assert seen[1].error.startswith(("DriverFailedError", "ReorganizerDiedError")), seen[1].error


def test_the_driver_process_dying_reaches_ranks_on_their_data_ring_and_on_the_schedule() -> None:
    """The driver's process SIGKILLed (liveness 5 s) while dp0/cp0 waits on its data ring for
    its train pass (dp0/cp1 is held before it writes back) and both dp1 ranks, done with the
    mini-batch, wait on the schedule for the next one (it never opens): each of the three raises
    ``DriverDiedError`` within the liveness bound (generous: 30 s), none waits out its own
    bound (``RankHandle.Config``'s waits are longer). The held rank, released, fails too."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=serve_held_job, args=(theirs,))  # it starts reorganizers
    process.start()
    threads: list[threading.Thread] = []
    held = Hold("tb0-mb0", "old")
    try:
        wait_for(lambda: ours.poll(0.2) or not process.is_alive(), 120, "driver started")
        assert process.is_alive(), f"the driver process exited with {process.exitcode}"
        spec = RankSpec.from_json(ours.recv_bytes().decode())
        entered = Hold("tb0-mb0", "train")
        entered.release.set()  # a marker: the rank goes on at once
        threads, seen, ended = _ranks(spec, grid(2, 2, 1, 1), {0: entered, 1: held})
        assert entered.reached.wait(60), "dp0/cp0 never started its train pass"
        ours.send_bytes(b"wait for dp1")
        assert ours.poll(120), "dp1 never finished tb0-mb0's train pass"
        ours.recv_bytes()
        os.kill(process.pid or 0, signal.SIGKILL)
        killed = time.monotonic()
        for i in (0, 2, 3):
            threads[i].join(60)
            assert seen[i].error.startswith("DriverDiedError"), (i, seen[i].error)
            assert ended[i] - killed < 30.0, (i, ended[i] - killed)
        assert "the driver is gone" in seen[0].error, seen[0].error
    finally:
        held.release.set()
        process.kill()
        process.join(30)
        join(threads)
    assert seen[1].error.startswith(("DriverDiedError", "ReorganizerDiedError")), seen[1].error
