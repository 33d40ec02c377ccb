"""Nothing hangs: write-back gaps, a dead reorganizer, rank or driver end in typed, named errors."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

import pytest
from job_harness import (
    Hold,
    controller,
    driver_config,
    grid,
    join,
    run_ranks,
    serve_driver,
    trajectories,
    wait_for,
)

from knitkit.job import (
    DriverDiedError,
    JobError,
    PassWork,
    ProcessPool,
    RankCoords,
    RankFailedError,
    RankHandle,
    RankSpec,
    ReorganizerFailedError,
    WriteBackMissingError,
)
from knitkit.job.errors import producer_failed
from knitkit.storage import ReorganizerDiedError, ReorganizerError
from knitkit.storage.delivery.slot_ring import STARTING

LIVENESS_S = 4.0
"""A short liveness bound: a stopped reorganizer is found silent within it (and a rank's report
of it waits at most as long for the pool's, NOTE [ A rank's producer failure ])."""


def test_a_missing_write_back_is_named_on_the_rank_and_the_driver() -> None:
    """A writer rank that ends the forward-only pass without micro-batch 0's output raises
    ``WriteBackMissingError`` naming the pass and micro-batch; the driver fails with the rank's
    error (``RankFailedError``) instead of waiting for the field."""
    data = trajectories(2, 2, seed=7)
    with driver_config(1, 1, 1, 1).build(admission=controller(data, 2)) as driver:
        threads, seen = run_ranks(driver.rank_spec(), grid(1, 1, 1, 1), skip_write=("tb0-mb0", 0))
        for trajectory in data:
            driver.write(trajectory)
        with pytest.raises(
            RankFailedError, match=r"WriteBackMissingError.*'old'.*\{'old_lp': \[0\]\}"
        ):
            driver.drain(60)
        join(threads)
    assert seen[0].error.startswith("WriteBackMissingError"), seen[0].error
    assert "'old' of 'tb0-mb0'" in seen[0].error


def test_the_driver_bounds_its_wait_for_a_pass_reads() -> None:
    """A writer that stops sending (a stuck rank) fails the driver after ``pass_timeout_s`` with
    ``WriteBackMissingError`` naming the mini-batch, pass, field and group; the rank, once it
    moves again, learns the driver failed (typed) instead of waiting for work."""
    data = trajectories(2, 2, seed=8)
    hold = Hold("tb0-mb0", "old")
    config = driver_config(1, 1, 1, 1, pass_timeout_s=1.0)
    with config.build(admission=controller(data, 2)) as driver:
        threads, seen = run_ranks(driver.rank_spec(), grid(1, 1, 1, 1), hold=hold)
        for trajectory in data:
            driver.write(trajectory)
        with pytest.raises(
            WriteBackMissingError,
            match=r"tb0-mb0/train waits for old_lp from \['backbone/dp0/cp0'\].*pass_timeout_s",
        ):
            driver.drain(60)
        hold.release.set()
        join(threads)
    assert seen[0].error.startswith("DriverFailedError"), seen[0].error
    assert "WriteBackMissingError" in seen[0].error


def test_a_dead_reorganizer_is_named_on_the_driver_and_typed_on_the_ranks() -> None:
    """A reorganizer process killed mid-job: the driver fails with ``ReorganizerFailedError``
    naming its group; every rank stops with a typed error (the dead ring's
    ``ReorganizerDiedError``, or the driver's failure), none waits."""
    data = trajectories(2, 2, seed=9)
    with driver_config(2, 1, 1, 1).build(admission=controller(data, 2)) as driver:
        threads, seen = run_ranks(driver.rank_spec(), grid(2, 1, 1, 1))
        assert isinstance(driver.pool, ProcessPool)
        os.kill(driver.pool.pids()["backbone/dp1/cp0"] or 0, signal.SIGKILL)
        for trajectory in data:
            try:
                driver.write(trajectory)
            except ReorganizerFailedError:
                break
        with pytest.raises(ReorganizerFailedError, match=r"backbone/dp1/cp0.*exited with code -9"):
            driver.drain(60)
        join(threads)
    for s in seen:
        assert s.error.startswith(("ReorganizerDiedError", "DriverFailedError")), s.error


def test_a_reorganizer_a_rank_found_dead_first_is_named_by_the_pool() -> None:
    """The driver names a failed reorganizer's group even where a rank it feeds reports it first
    (NOTE [ A rank's producer failure ] in knitkit/job/core.py). Group dp1's reorganizer process
    is stopped (SIGSTOP) once it serves: its pool sees it alive, while the rank waiting on its
    ring finds it silent past ``liveness_timeout_s`` and sends its error record; once that rank
    has raised, the process is killed and the pool sees the exit. The driver fails with the
    pool's ``ReorganizerFailedError`` naming the group; on 6571a70 with the rank's
    ``RankFailedError``, as a Ray node's loss did when the lost group's rank saw the dead actor
    first (tests/job/test_node_loss.py beside two busy loops)."""
    data = trajectories(2, 2, seed=9)
    config = driver_config(2, 1, 1, 1, liveness_timeout_s=LIVENESS_S)
    with config.build(admission=controller(data, 2)) as driver:
        assert isinstance(driver.pool, ProcessPool)
        member = driver.pool._members["backbone/dp1/cp0"]  # its ReorganizerProcess
        wait_for(lambda: member.ring.state != STARTING, what="the reorganizer serves")
        assert member.pid is not None
        os.kill(member.pid, signal.SIGSTOP)
        try:
            threads, seen = run_ranks(driver.rank_spec(), grid(2, 1, 1, 1))
            for trajectory in data:
                driver.write(trajectory)
            wait_for(lambda: bool(seen[1].error), what="dp1's rank raised")
        finally:
            os.kill(member.pid, signal.SIGKILL)
        with pytest.raises(ReorganizerFailedError, match=r"backbone/dp1/cp0.*exited with code -9"):
            driver.drain(60)
        join(threads)
    assert seen[1].error.startswith("ReorganizerDiedError"), seen[1].error
    assert "made no progress" in seen[1].error, seen[1].error


def test_a_producer_failure_is_read_off_the_error_chain_as_a_traceback_shows_it() -> None:
    """A rank's error record says a reorganizer caused it when a data ring's report is on the
    error's chain (raised from, or while handling it), and not where the chain was cut
    (``from None``: the driver's death, which takes its reorganizers along)."""

    def raised(outer: BaseException, *, cut: bool) -> BaseException:
        try:
            try:
                raise ReorganizerDiedError("reorganizer of ring 'r' (pid 7) died")
            except ReorganizerDiedError as died:
                if cut:
                    raise outer from None
                raise outer from died
        except BaseException as error:  # the error under test
            return error
        raise AssertionError("nothing raised")

    assert producer_failed(ReorganizerError("reorganizer of ring 'r': UnitsLostError ..."))
    assert producer_failed(raised(RuntimeError("the loop's own wrapper"), cut=False))
    assert not producer_failed(raised(DriverDiedError("rank 0: the driver is gone"), cut=True))
    assert not producer_failed(ValueError("the loss is NaN"))


def test_a_dead_writer_rank_fails_the_driver_with_a_named_error() -> None:
    """A writer rank's process SIGKILLed inside a pass: the driver's collector sees its
    write-back ring's producer gone and fails with ``RankFailedError`` naming the group."""
    data = trajectories(2, 2, seed=10)
    ctx = mp.get_context("spawn")
    with driver_config(1, 1, 1, 1, liveness_timeout_s=5.0).build(
        admission=controller(data, 2)
    ) as driver:
        reached = ctx.Event()
        rank = ctx.Process(
            target=_held_rank, args=(driver.rank_spec().to_json(), reached), daemon=True
        )
        rank.start()
        for trajectory in data:
            driver.write(trajectory)
        assert reached.wait(120), "the rank process did not take its first pass"
        wait_for(lambda: "old_lp from" in driver.progress().blocked, what="waiting for old_lp")
        os.kill(rank.pid or 0, signal.SIGKILL)
        with pytest.raises(
            RankFailedError, match=r"writer rank of backbone/dp0/cp0 stopped"
        ) as failed:
            driver.drain(60)
        rank.join(30)
    assert "reorganizer" not in str(failed.value)  # a rank, named as one (issue 30, item 15)


def _held_rank(spec_json: str, reached: Any) -> None:
    """A rank that attaches, takes its first pass, says so, and never moves (until killed)."""
    with RankHandle(RankSpec.from_json(spec_json), RankCoords(0, 0, encoder_rank=0)) as rank:
        rank.next_pass()
        reached.set()
        threading.Event().wait(300)


def test_ranks_raise_driver_died_when_the_driver_process_dies() -> None:
    """The driver's process SIGKILLed while a rank waits for its next pass: the rank raises
    ``DriverDiedError`` within the liveness bound instead of waiting for work."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=serve_driver, args=(theirs,))  # it starts reorganizers
    process.start()
    try:
        wait_for(lambda: ours.poll(0.2) or not process.is_alive(), 120, "driver started")
        assert process.is_alive(), f"the driver process exited with {process.exitcode}"
        spec = RankSpec.from_json(ours.recv_bytes().decode())
        with RankHandle(spec, RankCoords(0, 0, encoder_rank=0)) as rank:
            os.kill(process.pid or 0, signal.SIGKILL)
            with pytest.raises(DriverDiedError, match="the driver is gone"):
                rank.next_pass(timeout_s=60)
    finally:
        process.kill()
        process.join(30)


def test_a_pool_member_is_replaced_by_a_fresh_one_on_a_new_ring() -> None:
    """The recovery hook issue 21 builds on: ``ProcessPool.replace(group)`` retires a dead
    member and starts a fresh reorganizer on a new ring that serves re-submitted assignments
    from the store; the pool's health check passes again and its byte counts keep the old
    member's reads."""
    from knitkit.storage import (
        MicroBatchConsumer,
        PlannerConfig,
        SharedMemoryBackend,
        Topology,
        TrajectoryStore,
        plan_minibatch,
    )

    store = TrajectoryStore(SharedMemoryBackend())
    try:
        for trajectory in trajectories(1, 2, seed=13):
            store.write(trajectory)
        config = PlannerConfig(token_fields=("tokens",), scalar_fields=())
        plan = store.register(plan_minibatch(store.metas(), Topology(1), config, (), "m"))
        pool = ProcessPool(store.backend, {"backbone/dp0/cp0": 1}, slot_bytes=1 << 20)
        try:
            old = pool.rings["backbone/dp0/cp0"]
            pool.submit("backbone/dp0/cp0", "m", plan.consumers[0])
            with MicroBatchConsumer(old, 0) as consumer:
                for lease in consumer.take(plan.num_micro_batches):
                    lease.release()
            before = pool.metrics()["knitkit/delivery/reorganizer_bytes_read"]
            os.kill(pool.pids()["backbone/dp0/cp0"] or 0, signal.SIGKILL)
            wait_for(lambda: _fails(pool), what="the pool sees its member dead")
            new = pool.replace("backbone/dp0/cp0")
            assert new.name != old.name
            pool.check()
            pool.submit("backbone/dp0/cp0", "m", plan.consumers[0])  # re-served from the store
            with MicroBatchConsumer(new, 0) as consumer:
                leases = list(consumer.take(plan.num_micro_batches))
                tokens = sum(int(lease.layout.extra["num_tokens"]) for lease in leases)
                for lease in leases:
                    lease.release()
            assert tokens == sum(
                s.num_tokens for mb in plan.consumers[0].micro_batches for s in mb.sequences
            )
            assert pool.metrics()["knitkit/delivery/reorganizer_bytes_read"] == 2 * before
        finally:
            pool.close()
    finally:
        store.close()


def _fails(pool: ProcessPool) -> bool:
    try:
        pool.check()
    except ReorganizerFailedError:
        return True
    return False


def test_with_no_rank_attached_the_driver_names_the_cause_within_its_bound() -> None:
    """No rank ever attaches (a file that is not a whole ring sits under the writer rank's ring
    name): once the first pass is served the driver fails within ``attach_timeout_s`` with
    ``RankFailedError`` saying no rank attached to the group, not after ``pass_timeout_s``
    blaming a writer rank; a rank started after the driver closed is told the driver's rings
    are not on its node, not a bare ``FileNotFoundError`` (issue 30, items 8 and 14)."""
    from knitkit.storage.delivery import unlink_ring

    data = trajectories(2, 2, seed=11)
    config = driver_config(1, 1, 1, 1, attach_timeout_s=1.0)
    with config.build(admission=controller(data, 2)) as driver:
        spec = driver.rank_spec()
        ring = spec.write_back["backbone/dp0/cp0"].name
        with open(f"/dev/shm/{ring}", "wb"):
            pass  # named, 0 bytes: not a ring yet
        try:
            for trajectory in data:
                driver.write(trajectory)
            with pytest.raises(
                RankFailedError,
                match=r"no rank attached to backbone/dp0/cp0 .*not a complete ring.*ranks attached "
                r"to the schedule: 0 of 1",
            ):
                driver.drain(60)
        finally:
            unlink_ring(ring)
    with pytest.raises(JobError, match=r"rank 0: the driver's rings are not in /dev/shm.*node"):
        RankHandle(spec, RankCoords(0, 0, encoder_rank=0))


def _leave_in_first_pass(spec: RankSpec, coords: RankCoords) -> None:
    """A TP rank that takes its first micro-batch, then leaves through Python (an exception out
    of ``with RankHandle``: Ctrl-C, an error, sys.exit leave the same way)."""
    with contextlib.suppress(KeyboardInterrupt), RankHandle(spec, coords, device="cpu") as rank:
        work = rank.next_pass()
        assert isinstance(work, PassWork)
        with work:
            for _ in work.micro_batches():
                raise KeyboardInterrupt


def test_a_tp_rank_leaving_through_python_fails_its_peer_and_the_driver_fast() -> None:
    """A TP rank leaves mid-pass through Python (its consumers detach while the reorganizer still
    runs): the reorganizer fails the ring naming it once it waits for it, so its TP peer raises a
    typed error and the driver fails naming the group and the consumer (from the pool's health
    check or the peer's error record, whichever comes first), within seconds instead of the
    peer's wait_timeout_s and the driver's pass_timeout_s (issue 30, item 9)."""
    data = trajectories(8, 2, seed=12)
    with driver_config(1, 1, 2, 1).build(admission=controller(data, 4)) as driver:
        spec = driver.rank_spec()
        coords = grid(1, 1, 2, 1)
        threads, seen = run_ranks(spec, coords[:1])
        leaver = threading.Thread(target=_leave_in_first_pass, args=(spec, coords[1]), daemon=True)
        leaver.start()
        start = time.monotonic()
        for trajectory in data:
            try:
                driver.write(trajectory)
            except ReorganizerFailedError:
                break
        with pytest.raises(  # the reorganizer's failure, or the writer rank's report of it
            (ReorganizerFailedError, RankFailedError),
            match=r"(?s)backbone/dp0/cp0.*consumer 1 \(pid \d+\) .* left at micro-batch",
        ):
            driver.drain(60)
        assert time.monotonic() - start < 60
        join([*threads, leaver])
    assert seen[0].error.startswith(("ReorganizerError", "DriverFailedError")), seen[0].error
