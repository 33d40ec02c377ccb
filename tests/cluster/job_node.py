"""Run on simulated nodes.

- ``driver``: a one-rank job's driver (``LocalControl``); prints its ``RankSpec`` (JSON, one
  line), then holds it until its stdin closes. ``rank``: reads that line from stdin and attaches
  rank 0's ``RankHandle``, printing what it raised (or ``attached``).
- ``ray-driver ADDRESS...``: the DP2 x TP2 job of ``JOB`` on the Ray cluster, rank ``r`` on the
  node at ``ADDRESS[r]``: ``RayBackend`` store, ``RayDispatcher`` reorganizers and ``RayControl``
  relays on the ranks' nodes. Prints the spec, writes every trajectory, drains, prints
  ``{"figures": ..., "placed_on": {node address: written-back bytes placed there}}`` (or ``{"failed": error type, "message": ...}``), then holds the driver
  until its stdin closes (the ranks are done).
- ``ray-lose ADDRESS...``: ``ray-driver``'s job with a rollout writer actor on every ranks'
  node placing every other trajectory there; prints the spec and ``{"order", "placed_on"}``,
  waits for a line (every rank held at the last mini-batch's train pass), prints
  ``{"state": checkpoint}`` once the pending trajectories' write-backs are in, drains into
  the node's loss and prints ``{"failed", "message", "node", "ranks", "units"}``, then
  ``{"closed_s"}`` (its close). Resumes on ``ADDRESS[0]``
  alone: prints the new spec, has the writer there re-write what ``reissue()`` names, drains,
  prints ``{"pending", "reissue", "order"}`` and holds until its stdin closes.
- ``ray-cut ADDRESS``: one reorganizer actor on the node at ``ADDRESS`` (a ``RayDispatcher``)
  with an assignment in flight (its one-slot ring has no consumer); prints ``{"node"}`` (the
  Ray node id), waits for a line (the node was killed), polls the pool's ``check`` until it
  raises (at most ``WAIT_S``, else it fails) and prints ``{"failed", "unreachable_node"}``, then
  ``{"closed_s"}`` (its close).
- ``ranks FIRST COUNT SPEC_FILE [MINIBATCH]``: reads the spec from the file and runs ranks
  FIRST..FIRST+COUNT-1 of ``JOB`` (threads, ``job_harness.rank_loop``); prints what each saw
  (JSON, one line). With ``MINIBATCH`` every rank holds at its train pass: once all do, prints
  what they saw so far and goes on when its stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "job"))

from job_harness import (
    Hold,
    Seen,
    controller,
    driver_config,
    grid,
    join,
    rank_loop,
    run_ranks,
    trajectories,
    wait_for,
)

from knitkit.job import Driver, JobError, RankCoords, RankHandle, RankSpec
from knitkit.storage import Trajectory

JOB = {"dp": 2, "cp": 1, "tp": 2, "encoder_dp": 1, "samples": 4, "group": 2, "minibatches": 2}
"""The multi-node job: DP2 x TP2 (two ranks per node), one encoder rank, two mini-batches."""
WAIT_S = float(os.environ.get("KNITKIT_TEST_WAIT_S", "120"))
"""Bound of every wait of the job (a rank's, the driver's drain)."""
FIGURES = ("minibatches_released", "passes_consumed", "write_back_records", "write_back_bytes")
"""The driver's figures both runs of ``JOB`` must agree on (``knitkit/job/<name>``)."""


def job_config() -> Driver.Config:
    return driver_config(JOB["dp"], JOB["cp"], JOB["tp"], JOB["encoder_dp"], wait_timeout_s=WAIT_S)


def job_data() -> list[Trajectory]:
    return trajectories(JOB["samples"], JOB["group"], seed=5)


def job_coords() -> list[RankCoords]:
    return grid(JOB["dp"], JOB["cp"], JOB["tp"], JOB["encoder_dp"])


def figures(driver: Driver) -> dict[str, float]:
    metrics = driver.metrics()
    return {name: metrics[f"knitkit/job/{name}"] for name in FIGURES}


def placed_on(driver: Driver) -> dict[str, float]:
    """Bytes of written-back units the driver adopted, by the node (address) that placed them."""
    prefix = "knitkit/storage/written_back_bytes_adopted_on/"
    metrics = driver.metrics()
    return {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}


def seen_json(seen: Seen) -> dict[str, object]:
    """What one rank saw, as JSON: its tokens per ``"<mini-batch>/<pass>"``, mismatches, error."""
    return {
        "rank": seen.coords.rank,
        "tokens": {f"{mb}/{name}": tokens for (mb, name), tokens in seen.tokens.items()},
        "mismatches": seen.mismatches,
        "error": seen.error,
    }


def driver() -> None:
    data = trajectories(1, 2, seed=0)
    config = driver_config(1, 1, 1, 1, liveness_timeout_s=5.0, wait_timeout_s=30.0)
    with config.build(admission=controller(data, 1)) as job:
        print(job.rank_spec().to_json(), flush=True)
        sys.stdin.read()


def rank() -> None:
    spec = RankSpec.from_json(sys.stdin.readline())
    coords = RankCoords(rank=0, dp=0, cp=0, tp=0, encoder_rank=0)
    try:
        with RankHandle(spec, coords, device="cpu"):
            print("attached", flush=True)
    except Exception as error:
        print(f"{type(error).__name__}: {error}", flush=True)


def _ray_job(backend: object, addresses: list[str]) -> Driver:
    """``JOB``'s driver on the Ray cluster, rank ``r`` on the node at ``addresses[r]``:
    ``RayDispatcher`` reorganizers and ``RayControl`` relays on the ranks' nodes."""
    import ray

    from knitkit.integration.ray import RayBackend, RayControl, RayDispatcher, RingConfig
    from knitkit.storage import TrajectoryStore

    assert isinstance(backend, RayBackend)
    ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    placement = [ids[address] for address in addresses]
    config = job_config()
    groups = {c.rank: c for c in job_coords()}
    on = {  # every consumer group's reorganizer on the node of its ranks
        f"backbone/dp{c.dp}/cp{c.cp}": placement[r] for r, c in groups.items() if c.tp == 0
    }
    on.update(
        {
            f"vision/dp{c.encoder_rank}": placement[r]
            for r, c in groups.items()
            if c.encoder_rank is not None
        }
    )
    pool = RayDispatcher(
        backend,
        config.topology,
        encoders=config.encoders,
        placement=on,
        ring=RingConfig(num_slots=config.num_slots, slot_bytes=config.slot_bytes),
    )
    return config.build(
        admission=controller(job_data(), JOB["minibatches"]),
        store=TrajectoryStore(backend),
        pool=pool,
        control=RayControl(placement),
    )


def ray_driver(addresses: list[str]) -> None:
    import ray

    from knitkit.integration.ray import RayBackend

    ray.init(logging_level="ERROR", log_to_driver=False)
    backend = RayBackend()
    with _ray_job(backend, addresses) as job:
        print(job.rank_spec().to_json(), flush=True)
        try:
            for trajectory in job_data():
                job.write(trajectory)
            job.finish()
            job.drain(300)
            print(json.dumps({"figures": figures(job), "placed_on": placed_on(job)}), flush=True)
        except JobError as error:
            print(json.dumps({"failed": type(error).__name__, "message": str(error)}), flush=True)
        sys.stdin.read()
    backend.close()
    ray.shutdown()


def ray_lose(addresses: list[str]) -> None:
    """``ray-lose``: see the module docstring."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from knitkit.integration.ray import RayBackend
    from knitkit.job import NodeFailedError
    from knitkit.storage import PlacedTrajectory, UnitPlacer

    @ray.remote(num_cpus=0)
    class Writer:
        """A rollout writer on its node: places units there, returns the records."""

        def __init__(self, name: str) -> None:
            self.placer = UnitPlacer(RayBackend(name, create=False))

        def place(self, trajectory: Trajectory) -> dict[str, object]:
            return self.placer.place(trajectory).to_dict()

    ray.init(logging_level="ERROR", log_to_driver=False)
    ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    backend, data = RayBackend(), job_data()
    hosts = list(dict.fromkeys(addresses))
    writers = {
        a: Writer.options(  # type: ignore[attr-defined]
            scheduling_strategy=NodeAffinitySchedulingStrategy(ids[a], soft=False)
        ).remote(backend.name)
        for a in hosts
    }

    def placed(trajectory: Trajectory, host: str) -> PlacedTrajectory:
        return PlacedTrajectory.from_dict(ray.get(writers[host].place.remote(trajectory)))

    first = _ray_job(backend, addresses)
    try:
        where = {t.trajectory_id: hosts[i % len(hosts)] for i, t in enumerate(data)}
        for trajectory in data:
            first.adopt(placed(trajectory, where[trajectory.trajectory_id]))
        order = first.minibatches()
        print(first.rank_spec().to_json(), flush=True)
        print(json.dumps({"order": order, "placed_on": where}), flush=True)
        sys.stdin.readline()  # every rank holds at the last mini-batch's train pass
        state = first.state_dict(trained=len(order) - 1, timeout_s=WAIT_S)
        pending = [t for p in state["pending"] for t in p["trajectories"]]
        _await_written(first, pending)  # ranks reach the train pass before the driver has them
        print(json.dumps({"state": state}), flush=True)
        try:
            first.drain(300)
            print(json.dumps({"failed": None}), flush=True)
        except NodeFailedError as error:
            lost = {"node": error.node, "ranks": list(error.ranks)}
            units = [str(k) for k in error.units]
            failed = {"failed": "NodeFailedError", "message": str(error), **lost, "units": units}
            print(json.dumps(failed), flush=True)
        except JobError as error:
            print(json.dumps({"failed": type(error).__name__, "message": str(error)}), flush=True)
    finally:
        started = time.monotonic()
        first.close()
        print(json.dumps({"closed_s": time.monotonic() - started}), flush=True)
    survivor = addresses[0]  # every rank on the first rank's node
    with _ray_job(backend, [survivor] * len(addresses)) as second:
        resumed = second.load_state_dict(state)
        reissue = second.reissue()
        print(second.rank_spec().to_json(), flush=True)
        by_id = {t.trajectory_id: t for t in data}
        for tid in reissue:  # re-written by the writer on the surviving node
            second.adopt(placed(by_id[tid], survivor))
        second.finish()
        second.drain(300)
        print(
            json.dumps(
                {
                    "pending": list(resumed.pending),
                    "reissue": list(reissue),
                    "order": list(second.minibatches()),
                }
            ),
            flush=True,
        )
        sys.stdin.read()
    backend.close()
    ray.shutdown()


def _await_written(job: Driver, trajectories: list[str]) -> None:
    """Wait (bounded) until every written field of ``trajectories`` is in the driver's store:
    placed by the writer ranks' relays and adopted."""
    fields = [o.name for p in job.config.passes for o in p.writes]
    deadline = time.monotonic() + WAIT_S
    pause = threading.Event()
    while not all(job.store.field_complete(t, f) for t in trajectories for f in fields):
        assert time.monotonic() < deadline, f"write-backs of {trajectories} not in by {WAIT_S} s"
        pause.wait(0.05)


def ranks(first: int, count: int, spec_file: str, held: str = "") -> None:
    """Ranks FIRST.. of ``JOB``; with ``held`` (a mini-batch id), each holds at its train pass:
    once all did, print what they saw so far (JSON, one line) and go on when stdin closes."""
    spec = RankSpec.from_json(Path(spec_file).read_text())
    coords = job_coords()[first : first + count]
    if not held:
        threads, seen = run_ranks(spec, coords)
    else:
        holds = [Hold(held, "train") for _ in coords]
        seen = [Seen(c) for c in coords]

        def run(i: int) -> None:
            seen[i] = rank_loop(spec, coords[i], hold=holds[i])

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + WAIT_S
        for hold, thread in zip(holds, threads, strict=True):  # held, or ended (its error)
            while not hold.reached.wait(0.1) and thread.is_alive():
                assert time.monotonic() < deadline, "a rank did not reach the held pass"
        print(
            json.dumps([seen_json(h.seen or s) for h, s in zip(holds, seen, strict=True)]),
            flush=True,
        )
        sys.stdin.read()
        for hold in holds:
            hold.release.set()
    join(threads, 300)
    print(json.dumps([seen_json(s) for s in seen]), flush=True)


def ray_cut(address: str) -> None:
    """``ray-cut ADDRESS``: see the module docstring."""
    import ray

    from knitkit.integration.ray import RayBackend, RayDispatcher, RingConfig
    from knitkit.job.pool import ReorganizerDied
    from knitkit.storage import PlannerConfig, Topology, TrajectoryStore, plan_minibatch
    from knitkit.storage.baselines.synthetic import synthetic_trajectories

    ray.init(logging_level="ERROR", log_to_driver=False)
    node = next(
        n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == address
    )
    backend = RayBackend()
    store = TrajectoryStore(backend)
    data = synthetic_trajectories(2, group_size=2, max_tokens=300)
    for trajectory in data:
        store.write(trajectory)
    config = PlannerConfig(
        token_fields=("tokens", "logprobs", "loss_mask"),
        scalar_fields=("reward",),
        min_micro_batches=4,
    )
    plan = plan_minibatch(
        store.metas([t.trajectory_id for t in data]), Topology(1), config, minibatch_id="mb0"
    )
    group = "backbone/dp0/cp0"
    pool = RayDispatcher(
        backend,
        plan.topology,
        placement={group: node},
        ring=RingConfig(num_slots=1, slot_bytes=1 << 20),
    )
    try:
        pool.submit(group, "mb0", plan.consumers[0])
        print(json.dumps({"node": node}), flush=True)
        sys.stdin.readline()  # the node is killed
        raised: list[ReorganizerDied] = []

        def pool_raised() -> bool:
            try:
                pool.check()
            except ReorganizerDied as error:
                raised.append(error)
            return bool(raised)

        wait_for(pool_raised, WAIT_S, "the pool's check to raise after the node's loss")
        failed = raised[0]
        out = {"failed": type(failed).__name__, "unreachable_node": failed.unreachable_node}
        print(json.dumps(out), flush=True)
    finally:
        started = time.monotonic()
        pool.close()
        print(json.dumps({"closed_s": time.monotonic() - started}), flush=True)
        backend.close()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "driver":
        driver()
    elif mode == "rank":
        rank()
    elif mode == "ray-driver":
        ray_driver(sys.argv[2:])
    elif mode == "ray-lose":
        ray_lose(sys.argv[2:])
    elif mode == "ray-cut":
        ray_cut(sys.argv[2])
    else:
        ranks(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
