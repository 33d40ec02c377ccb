"""A reorganizer that dies mid-pass is restarted without restarting the job: its pass is re-served
from the store and every rank still gets every micro-batch exactly once (issue 21, item 4)."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from job_harness import (
    controller,
    driver_config,
    grid,
    join,
    output_of,
    trajectories,
    wait_for,
)

from knitkit.job import (
    Driver,
    ProcessPool,
    RankCoords,
    RankHandle,
    RankSpec,
    ReorganizerFailedError,
)
from knitkit.job.control import NodeAware
from knitkit.job.pool import ReorganizerDied
from knitkit.job.recovery import RestartingPool
from knitkit.storage import (
    EncoderTopology,
    PlannerConfig,
    SharedMemoryBackend,
    Topology,
    TrajectoryStore,
)

DP, TP = 2, 2
"""Two (DP, CP) groups of two TP ranks: both TP ranks of the killed group must stay in step."""
KILLED = "backbone/dp1/cp0"
KILL_AT = ("tb0-mb0", "old", 1)
"""(mini-batch, pass, micro-batch): the killed group's TP 0 rank kills its reorganizer right
after it got this micro-batch, with later ones of the pass still unpublished. The first pass:
it is one assignment (a pass that reads write-backs may come in several, one per arrival:
NOTE [ Serving as write-backs arrive ], so its published ones are not re-served)."""
LAST_OF_PASS = ("tb0-mb0", "train", 7)
"""The last micro-batch of the first mini-batch's last pass (8 per group and pass)."""


@dataclass
class Run:
    """What one rank got: per (mini-batch, pass) the packed bytes of each micro-batch, in order."""

    coords: RankCoords
    packed: dict[tuple[str, str], list[bytes]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    error: str = ""


def _rank(spec: RankSpec, coords: RankCoords, run: Run, hook: Callable[[str, str, int], None]):
    try:
        with RankHandle(spec, coords, device="cpu") as rank:
            for work in rank.passes():
                key = (work.minibatch_id, work.pass_.name)
                with work:
                    work.encoder_inputs()
                    packed = run.packed.setdefault(key, [])
                    for i, mb in enumerate(work.micro_batches()):
                        packed.append(mb.flat.numpy().tobytes())
                        hook(work.minibatch_id, work.pass_.name, i)
                        real = mb["loss_mask"] > 0
                        if work.pass_.writes:
                            work.write_back(i, {"old_lp": output_of(mb["tokens"])})
                        elif not torch.equal(mb["old_lp"][real], output_of(mb["tokens"][real])):
                            run.mismatches.append(f"{key} micro-batch {i}")
            run.figures = rank.metrics()
    except BaseException as error:  # recorded for the test to assert on
        run.error = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"


def _job(
    restarts: int,
    kill: Callable[[Driver], Callable[[], None]] | None,
    *,
    at: tuple[str, str, int] = KILL_AT,
    tp_rank: int = 0,
    **build: object,
) -> tuple[list[Run], dict[str, float]]:
    """The same job (8 micro-batches per group and pass); ``kill(driver)`` gives the killer the
    killed group's ``tp_rank`` calls when it got micro-batch ``at`` (mini-batch, pass, index)."""
    data = trajectories(8, 4, seed=21)
    planner = PlannerConfig(max_tokens_per_micro_batch=256, min_micro_batches=8)
    config = driver_config(DP, 1, TP, 1, planner=planner, restart_reorganizers=restarts)
    coords = grid(DP, 1, TP, 1)
    runs = [Run(c) for c in coords]
    with config.build(admission=controller(data, 2), **build) as driver:  # type: ignore[arg-type]
        killer = kill(driver) if kill is not None else None

        def hook(minibatch_id: str, pass_name: str, index: int) -> None:
            if killer is not None and (minibatch_id, pass_name, index) == at:
                killer()

        spec = driver.rank_spec()
        threads = []
        for c, run in zip(coords, runs, strict=True):
            on = hook if (c.dp, c.tp) == (1, tp_rank) else _nothing
            threads.append(threading.Thread(target=_rank, args=(spec, c, run, on), daemon=True))
        for thread in threads:
            thread.start()
        for trajectory in data:
            driver.write(trajectory)
        driver.finish()
        try:
            driver.drain(180)
        finally:
            join(threads, 180)  # also after a failure: every rank ends, typed (none waits)
        return runs, driver.metrics()


def _sigkill(driver: Driver) -> Callable[[], None]:
    """SIGKILL the killed group's reorganizer process."""
    pid = _process_pool(driver).pids()[KILLED] or 0
    return lambda: os.kill(pid, signal.SIGKILL)


def _process_pool(driver: Driver) -> ProcessPool:
    pool = driver.pool.pool if isinstance(driver.pool, RestartingPool) else driver.pool
    assert isinstance(pool, ProcessPool)
    return pool


def _check_exactly_once(
    baseline: list[Run], runs: list[Run], figures: dict[str, float], min_dropped: int = 2
) -> None:
    """Per rank and (mini-batch, pass): the same packed micro-batches as the uninterrupted run,
    each once, in order; bit-exact write-backs; the killed group's ranks moved once and dropped
    the same re-served micro-batches (at least ``min_dropped``: the two they had taken
    mid-pass; after a pass's end, what the dead ring had published of the next one)."""
    assert [r.error for r in baseline + runs if r.error] == []
    assert figures["knitkit/job/reorganizer_restarts"] == 1
    for base, run in zip(baseline, runs, strict=True):
        assert run.mismatches == [], run.mismatches
        assert set(run.packed) == set(base.packed) and len(base.packed) == 4  # 2 mb x 2 passes
        for key, packed in base.packed.items():
            assert len(packed) == 8, (run.coords, key)
            assert run.packed[key] == packed, (run.coords, key)  # once each, in order, same bytes
        moves = run.figures["knitkit/delivery/reorganizer_moves"]
        assert moves == (1 if run.coords.dp == 1 else 0), (run.coords, moves)
    drops = {r.figures["knitkit/delivery/re_served_dropped"] for r in runs if r.coords.dp == 1}
    assert len(drops) == 1 and min(drops) >= min_dropped, drops  # both TP ranks: the same ones


def _nothing(minibatch_id: str, pass_name: str, index: int) -> None:
    pass


def test_a_killed_reorganizer_is_restarted_and_its_pass_re_served_exactly_once() -> None:
    """SIGKILL the reorganizer process of one (DP, CP) group of a DP2 x TP2 job mid-pass
    (micro-batch 1 of 8 of the first pass taken, later ones unpublished): the job completes, the
    pool restarted it once, and every rank got every micro-batch of every pass exactly once, in
    order (packed bytes equal to the uninterrupted job's), with bit-exact write-backs; both TP
    ranks of the group resumed the pass at the same micro-batch. On d6f4b7a there is no restart
    (``Driver.Config.restart_reorganizers`` does not exist; the kill fails the job)."""
    started = time.monotonic()
    baseline, _ = _job(2, None)
    runs, figures = _job(2, _sigkill)
    _check_exactly_once(baseline, runs, figures)
    print(f"two jobs in {time.monotonic() - started:.1f} s")


def test_a_restart_while_a_rank_holds_a_passs_last_micro_batch_frees_no_unit_early() -> None:
    """SIGKILL the reorganizer when the group's TP 1 rank got the last micro-batch of the
    mini-batch's last pass, and hold that rank (its lease unreleased) until the pool restarted
    the reorganizer and the group's writer rank (TP 0) ended the pass: the job completes with
    every micro-batch exactly once. A restart re-serves exactly what the dead member had not
    published (its ranks read the rest from the dead ring), and a group's units are freed only
    once nothing may read them again. On 480348c the pool re-served what a consumer had not
    released, after the pass end had freed its units: the successor failed the job with
    ``KeyError`` naming a unit (the race of the Ray actor restart, made certain)."""
    baseline, _ = _job(2, None)
    runs, figures = _job(2, _holding(_sigkill), at=LAST_OF_PASS, tp_rank=1)
    _check_exactly_once(baseline, runs, figures, min_dropped=0)


def _holding(
    kill: Callable[[Driver], Callable[[], None]],
) -> Callable[[Driver], Callable[[], None]]:
    """``kill``, then hold the killing rank (its micro-batch unreleased) until the pool restarted
    the group's reorganizer and the group's writer rank ended the pass of ``LAST_OF_PASS``."""

    def holding(driver: Driver) -> Callable[[], None]:
        killer = kill(driver)
        restarting = driver.pool
        assert isinstance(restarting, RestartingPool)

        def hold() -> None:
            killer()
            wait_for(lambda: restarting.restarted == [KILLED], 120, "the restart")
            wait_for(lambda: driver.consumed(*LAST_OF_PASS[:2]), 120, "the writer's pass end")

        return hold

    return holding


def test_without_restarts_the_job_fails_naming_the_group() -> None:
    """``restart_reorganizers=0`` keeps the old contract: the same kill fails the job with
    ``ReorganizerFailedError`` naming the group (a regression guard, not new behaviour)."""
    with pytest.raises(ReorganizerFailedError, match=r"backbone/dp1/cp0.*exited with code -9"):
        _job(0, _sigkill)


def test_a_death_past_the_restart_budget_fails_the_job_naming_it() -> None:
    """``restart_reorganizers=1``: the group's reorganizer is killed, restarted, and its successor
    killed too: the job fails with ``ReorganizerFailedError`` saying the budget is used, and
    every rank ends (typed) instead of waiting. On d6f4b7a no restart exists at all."""

    def twice(driver: Driver) -> Callable[[], None]:
        pool = _process_pool(driver)

        def kill() -> None:
            first = pool.pids()[KILLED] or 0
            os.kill(first, signal.SIGKILL)

            def again() -> None:
                wait_for(lambda: pool.pids()[KILLED] != first, 60, "the restarted reorganizer")
                os.kill(pool.pids()[KILLED] or 0, signal.SIGKILL)

            threading.Thread(target=again, daemon=True).start()

        return kill

    with pytest.raises(
        ReorganizerFailedError, match=r"backbone/dp1/cp0.*1 of restart_reorganizers=1 restarts"
    ):
        _job(1, twice)


def test_a_killed_ray_reorganizer_actor_is_restarted_and_re_served_exactly_once(
    local_ray: None,
) -> None:
    """The same job on a real local Ray cluster (``RayDispatcher`` pool, ``RayBackend`` store):
    ``ray.kill`` of the group's reorganizer actor mid-pass, and again in a second job when a
    rank got the last micro-batch of a pass (held until the restart and the pass end); the
    dispatcher restarts it on the same node, re-submits the ``deliver`` calls it had not seen
    return, and every rank still gets every micro-batch exactly once, in order, as in the
    uninterrupted Ray job. On d6f4b7a the kill fails the job; on 480348c the restart raced (the
    group's units could be freed before the successor re-read them: ``KeyError``). A group whose
    node the job lost (``node_lost``) is not restarted: ``replace`` refuses at once, naming the
    node (on 2cc1a5d it restarted it there while Ray still listed the node: a lost node's fresh
    actor never starts, 120 s)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'knitkit[ray]')")
    from knitkit.integration.ray import RayBackend, RayDispatcher, RingConfig
    from knitkit.storage.delivery import unlink_ring

    backend = RayBackend()
    started = time.monotonic()

    def pool() -> RayDispatcher:
        return RayDispatcher(
            backend,
            Topology(dp=DP, tp=TP),
            encoders=(EncoderTopology("vision", dp=1),),
            ring=RingConfig(num_slots=2, slot_bytes=1 << 20),
        )

    def ray_kill(driver: Driver) -> Callable[[], None]:
        name = f"knitkit-reorganizer/{driver.pool.rings[KILLED].name}"
        actor = ray.get_actor(name)

        def kill() -> None:
            # ray.kill returns before the actor is gone: wait (bounded) until it is, so the death
            # lands mid-pass like a process SIGKILL, while this rank holds the ring's slots.
            ray.kill(actor)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    ray.get(actor.published.remote(), timeout=10)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    return
            raise AssertionError("the killed reorganizer actor still answers after 60 s")

        return kill

    try:
        baseline, _ = _job(2, None, store=TrajectoryStore(backend), pool=pool())
        runs, figures = _job(2, ray_kill, store=TrajectoryStore(backend), pool=pool())
        _check_exactly_once(baseline, runs, figures)
        runs, figures = _job(
            2,
            _holding(ray_kill),
            at=LAST_OF_PASS,
            tp_rank=1,
            store=TrajectoryStore(backend),
            pool=pool(),
        )
        _check_exactly_once(baseline, runs, figures, min_dropped=0)
        cut_off = pool()
        head = ray.get_runtime_context().get_node_id()
        cut_off.node_lost(head)
        with pytest.raises(ReorganizerFailedError, match=rf"{KILLED}: its node {head} is gone"):
            cut_off.replace(KILLED)
        cut_off.close()  # waits for nothing on the lost node, its rings left to the node
        for spec in cut_off.rings.values():
            assert unlink_ring(spec.name), spec.name  # one machine: the "lost" node's outlive it
    finally:
        backend.close()
    print(f"three Ray jobs in {time.monotonic() - started:.1f} s")


class _NodeAwarePool(ProcessPool):
    """A ``ProcessPool`` that keeps the nodes ``node_lost`` named (``NodeAware``, as
    ``RayDispatcher`` is: its ``close`` then waits for nothing on them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lost: list[str] = []

    def node_lost(self, node: str) -> None:
        self.lost.append(node)


def _died(pool: ProcessPool) -> bool:
    try:
        pool.check()
    except ReorganizerDied:
        return True
    return False


def test_a_lost_node_reaches_the_wrapped_pool_and_nothing_is_restarted_after_it() -> None:
    """Invariant: once the job lost a node (``Driver.close`` after ``NodeFailedError`` tells a
    ``NodeAware`` pool), a ``RestartingPool`` (``restart_reorganizers > 0``) passes the node on
    to the pool it wraps and restarts no member that dies: the job fails as a whole, the error
    names the lost node. On 2cc1a5d ``RestartingPool`` had no ``node_lost``: the driver skipped
    it, so a ``RayDispatcher`` under it waited at close on every actor of the lost node (30 s
    each)."""
    store = TrajectoryStore(SharedMemoryBackend())
    inner = _NodeAwarePool(store.backend, {KILLED: 1}, slot_bytes=1 << 20)
    restarting = RestartingPool(inner, 1)
    try:
        assert isinstance(restarting, NodeAware)
        restarting.node_lost("node-2")
        assert inner.lost == ["node-2"]
        pid = inner.pids()[KILLED]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: _died(inner), what="the pool sees its member dead")
        with pytest.raises(ReorganizerFailedError) as failed:
            restarting.check()
        message = str(failed.value)
        assert KILLED in message and "not restarted: the job lost node(s) ['node-2']" in message
        assert not isinstance(failed.value, ReorganizerDied), "a restartable error"
        assert restarting.restarted == [] and inner.pids()[KILLED] == pid
    finally:
        restarting.close()
        store.close()


def test_a_successor_ring_not_complete_yet_counts_as_not_there() -> None:
    """A rank following its dead reorganizer finds a file under the successor's name that is
    not a whole ring (what a creator's first instant looked like before rings were created
    complete): it keeps looking within ``liveness_timeout_s``, then raises
    ``ReorganizerDiedError`` naming the successor and what it found, not ``RingTruncatedError``
    at once (issue 30, item 8)."""
    from knitkit.job.pool import successor_ring
    from knitkit.job.recovery import FollowingConsumer
    from knitkit.storage.delivery import ReorganizerDiedError, RingSpec, unlink_ring
    from knitkit.storage.delivery.publication import Publisher
    from knitkit.storage.delivery.slot_ring import SlotRing

    spec = RingSpec.new(num_slots=2, slot_bytes=4096, num_consumers=1)
    successor = successor_ring(spec)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    follower = FollowingConsumer(spec, 0, restarts=1, liveness_timeout_s=1.0, wait_timeout_s=60)
    try:
        with open(f"/dev/shm/{successor.name}", "wb"):
            pass  # named, 0 bytes
        publisher.close()  # the reorganizer is gone without a word
        with pytest.raises(
            ReorganizerDiedError,
            match=rf"no restarted reorganizer on \['{successor.name}'\].*not a complete ring",
        ):
            follower.next_micro_batch(cancel=threading.Event())
    finally:
        follower.close()
        unlink_ring(successor.name)
        owner.close()
        owner.unlink()
