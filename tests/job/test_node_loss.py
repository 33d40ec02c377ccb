"""A lost Ray node fails the job naming its group and node; the job resumes from its checkpoint on
the surviving node and trains every trajectory exactly once per pass (issue 21, item 4)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import pytest
from job_harness import Hold, assert_trained_once, controller, driver_config, grid, join, run_ranks
from job_harness import trajectories as make_trajectories

from knitkit.job import ReorganizerFailedError
from knitkit.storage import EncoderTopology, PlannerConfig, Topology, TrajectoryStore
from knitkit.storage.delivery import unlink_ring

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'knitkit[ray]')")

from ray.cluster_utils import Cluster  # noqa: E402
from ray_cluster import local_cluster  # noqa: E402

from knitkit.integration.ray import (  # noqa: E402
    RayBackend,
    RayDispatcher,
    RingConfig,
    loopback_only,
)

LOST = "backbone/dp1/cp0"
"""The consumer group whose reorganizer actor runs on the worker node that is removed."""
LIVENESS_S = 10.0
"""The job's liveness bound: with restarts allowed, the lost group's rank (a thread here; on a
real cluster it died with the node) waits this long for a successor ring before it ends."""
FAIL_S = 60.0
"""Bound from the node's removal to the driver's failure (generous: 2 shared cores)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A real local Ray cluster: one head node (the driver's); each test adds a worker node."""
    with local_cluster(log_to_driver=False) as made:
        yield made


def _pool(backend: RayBackend, placement: dict[str, str]) -> RayDispatcher:
    return RayDispatcher(
        backend,
        Topology(dp=2),
        encoders=(EncoderTopology("vision", dp=1),),
        placement=placement,
        ring=RingConfig(num_slots=2, slot_bytes=1 << 20),
    )


@pytest.mark.parametrize("restarts", [0, 2])
def test_a_lost_node_fails_the_job_named_and_its_checkpoint_resumes_exactly_once(
    cluster: Cluster, restarts: int
) -> None:
    """Invariant over the interrupted and the resumed run together: every admitted token is
    trained exactly once per pass (nothing lost, nothing twice) although a Ray node died mid-pass.

    A DP2 job on a RayDispatcher, group ``backbone/dp1/cp0``'s reorganizer actor pinned to a
    worker node; a checkpoint at the step boundary after two of four mini-batches; the worker
    node is removed while the third mini-batch's train pass is served, both ranks held at its
    start (its actor had published at most 2 of its micro-batches; before stop 52 only the first
    rank to get there was, so the lost group's rank could still be in an earlier pass). The
    driver fails within ``FAIL_S`` with ``ReorganizerFailedError`` naming the group and the
    node, also with restarts allowed (no attempt to place on the dead node); no stored unit is
    lost (the driver put them all, on its own node). A fresh driver with every group on the
    surviving node loads the checkpoint, names exactly the trajectories of the untrained
    mini-batches, gets them re-written and finishes. (Store-level lost units, put from a lost
    node, are ``UnitsLostError`` naming their keys: tests/storage/test_units_lost.py.) On
    d6f4b7a ``Driver.state_dict`` does not exist."""
    data = make_trajectories(8, 2, seed=17)
    by_id = {t.trajectory_id: t for t in data}
    planner = PlannerConfig(max_tokens_per_micro_batch=256, min_micro_batches=6)
    config = driver_config(
        2, 1, 1, 1, planner=planner, restart_reorganizers=restarts, liveness_timeout_s=LIVENESS_S
    )
    coords = grid(2, 1, 1, 1)
    head = ray.get_runtime_context().get_node_id()
    backend = RayBackend()
    started = time.monotonic()
    try:
        with loopback_only():
            worker = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        pool = _pool(backend, {LOST: worker.node_id})
        lost_ring = pool.rings[LOST].name
        assert pool.nodes[LOST][0] == worker.node_id and pool.nodes["vision/dp0"][0] == head
        first = config.build(
            admission=controller(data, 4), store=TrajectoryStore(backend), pool=pool
        )
        hold = Hold("", "train", parties=len(coords))  # every rank, the lost group's too
        threads = []
        try:
            for trajectory in data:
                first.write(trajectory)
            order = first.minibatches()
            assert len(order) == 4
            hold.minibatch_id = order[2]
            threads, seen_first = run_ranks(first.rank_spec(), coords, hold=hold)
            assert hold.reached.wait(120), "a rank never reached the third mini-batch's train pass"
            state = json.loads(json.dumps(first.state_dict(trained=2, timeout_s=60)))
            cluster.remove_node(worker)
            removed = time.monotonic()
            hold.release.set()
            with pytest.raises(ReorganizerFailedError) as failed:
                first.drain(FAIL_S + 60)
            took = time.monotonic() - removed
            assert took < FAIL_S, f"the driver took {took:.1f} s to fail"
            message = str(failed.value)
            assert LOST in message and worker.node_id in message, message
            assert restarts == 0 or "is gone" in message, message  # not a placement timeout
            read = 0
            for key in list(backend.keys()):  # the driver put every unit, on its node: none is lost
                with contextlib.suppress(KeyError):  # freed since listed (group dp0 went on)
                    read += backend.read(key).size > 0  # UnitsLostError (a LookupError) fails
            assert read > 0
        finally:
            hold.release.set()
            first.close()
            unlink_ring(lost_ring)  # one machine: the "lost" node's shared memory outlives it
        join(threads)
        assert first.failure is failed.value
        cut = seen_first[1]  # the lost group's rank: its train pass of order[2] never completed
        assert cut.error and (order[2], "train") not in cut.tokens, cut.error

        pool = _pool(backend, {})
        assert {node for node, _ in pool.nodes.values()} == {head}
        with config.build(
            admission=controller(data, 4), store=TrajectoryStore(backend), pool=pool
        ) as second:
            resumed = second.load_state_dict(state)
            assert resumed.released == 2 and resumed.pending == tuple(order[2:])
            pending = {t for p in state["pending"] for t in p["trajectories"]}
            assert set(second.reissue()) == pending
            threads, seen_second = run_ranks(second.rank_spec(), coords)
            for tid in second.reissue():
                second.write(by_id[tid])
            second.finish()
            second.drain(120)
            join(threads)
            assert second.minibatches() == order
    finally:
        backend.close()
    assert not [s.error for s in seen_second if s.error]
    assert not [m for s in seen_first + seen_second for m in s.mismatches]
    assert_trained_once(seen_first, order[:2], seen_second, data)
    print(
        f"restarts={restarts}: failed {took:.1f} s after the loss, both runs in "
        f"{time.monotonic() - started:.1f} s"
    )
