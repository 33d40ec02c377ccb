"""The driver keeps metadata only: its RSS stays flat while the payload per step grows 10x, with
the rollout writer on another node than the driver and the reorganizers on a third.

Run as a script, this file is one role of the test on a simulated node (``driver`` or
``writer``); pytest runs the test, which starts both.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest

from knitkit.testing import SimulatedCluster, unavailable_reason

REASON = unavailable_reason()
NAMESPACE = "knitkit-driver-rss"
STEPS = 3
"""Steps at each payload size (the 1x steps first)."""
PER_STEP = 8
"""Trajectories per step: two GRPO groups of 4, one image per group."""
MARGIN = 12 << 20
"""Most the driver's RSS may grow over the 10x steps (they carry ~124 MiB of units)."""


def _sizes(scale: int) -> dict[str, int]:
    """synthetic_trajectories' sizes at payload ``scale`` (1 or 10): the same tokens and
    metadata, ``scale`` x the bytes per routing row and per image (~4.3 MiB a step at 1x)."""
    return {
        "min_tokens": 1024,
        "max_tokens": 1024,
        "routing_layers": 8 * scale,
        "image_patches": 256,
        "patch_dim": 512 * scale,
    }


def _rss() -> dict[str, int]:
    """This process's resident memory (kB lines of /proc/self/status), after a collection."""
    gc.collect()
    lines = Path("/proc/self/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines)
    return {k: int(fields[k].split()[0]) << 10 for k in ("VmRSS", "RssAnon", "RssShmem")}


def _driver(reorganizer_node: str) -> None:
    """Node 0: a job driver over a RayBackend whose reorganizers run on ``reorganizer_node``;
    adopts the JSON records on stdin; ``rss`` answers its RSS, ``metrics`` its figures."""
    import ray

    from knitkit.admission import build_controller
    from knitkit.integration.ray import RayBackend, RayDispatcher, RingConfig
    from knitkit.job import Driver, Pass
    from knitkit.storage import (
        EncoderTopology,
        PlacedTrajectory,
        PlannerConfig,
        Topology,
        TrajectoryStore,
    )

    ray.init(namespace=NAMESPACE, logging_level="ERROR")
    node = next(n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == reorganizer_node)
    backend = RayBackend()
    topology, encoder = Topology(dp=1, cp=1, tp=1), EncoderTopology("vision", dp=1)
    dispatcher = RayDispatcher(
        backend,
        topology,
        encoders=[encoder],
        placement={"backbone/dp0/cp0": node, "vision/dp0": node},
        ring=RingConfig(num_slots=2, slot_bytes=16 << 20),
    )
    config = Driver.Config(
        passes=(Pass("train", reads=("tokens", "logprobs", "routing", "reward"), encodes=True),),
        topology=topology,
        encoders=(encoder,),
        planner=PlannerConfig(max_tokens_per_micro_batch=2048),
        slot_bytes=16 << 20,
    )
    admission = build_controller(
        "streaming", train_batch_size=PER_STEP, num_minibatches=1, sources=["src0", "src1"]
    )
    print(json.dumps({"backend": backend.name}), flush=True)
    with config.build(admission=admission, store=TrajectoryStore(backend), pool=dispatcher) as job:
        for line in sys.stdin:
            if line.startswith("rss"):
                print(json.dumps(_rss()), flush=True)
            elif line.startswith("metrics"):
                print(json.dumps(job.metrics()), flush=True)
                break
            else:
                job.adopt(PlacedTrajectory.from_dict(json.loads(line)))
    dispatcher.close()
    backend.close()


def _writer(backend_name: str) -> None:
    """Node 1: place each step's trajectories (1x, then 10x) from this process and print each
    record; stay alive (the owner of the units) until stdin closes."""
    import ray

    from knitkit.integration.ray import RayBackend
    from knitkit.storage import UnitPlacer
    from knitkit.storage.baselines import synthetic_trajectories

    ray.init(namespace=NAMESPACE, logging_level="ERROR")
    placer = UnitPlacer(RayBackend(backend_name, create=False))
    for step, scale in enumerate([1] * STEPS + [10] * STEPS):
        placed_bytes = 0
        for trajectory in synthetic_trajectories(2, group_size=4, seed=step, **_sizes(scale)):
            renamed = dataclasses.replace(
                trajectory,
                trajectory_id=f"p{step}{trajectory.trajectory_id}",
                sample_id=f"p{step}{trajectory.sample_id}",
            )
            placed = placer.place(renamed)
            placed_bytes += sum(s.nbytes for s in placed.specs.values())
            print(json.dumps(placed.to_dict()), flush=True)
        print(json.dumps({"step": step, "placed_bytes": placed_bytes}), flush=True)
    sys.stdin.read()


def _line(stream: IO[str] | None, who: str) -> dict[str, Any]:
    assert stream is not None
    line = stream.readline()
    assert line.startswith("{"), f"the {who} stopped: {line!r}"
    out: dict[str, Any] = json.loads(line)
    return out


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_driver_rss_stays_flat_while_the_payload_per_step_grows_10x() -> None:
    """A writer on node 1 places every trajectory's units on its node and sends the driver (node
    0) JSON records; reorganizers on node 2 read the units across the link. Three steps at 1x
    payload, then three at 10x (~41 MiB a step): the driver's RSS grows by less than
    ``MARGIN`` (12 MiB) over the 10x steps, and its metrics show the reorganizers' reads came
    from node 1 over the link node 1 -> node 2, none from the driver's node."""
    config = SimulatedCluster.Config(ray_cpus=2)
    with SimulatedCluster(3, config=config) as cluster:
        me = [sys.executable, str(Path(__file__).resolve())]
        driver = cluster.node(0).popen(
            [*me, "driver", cluster.node(2).address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert driver.stdin is not None
        name = _line(driver.stdout, "driver")["backend"]
        writer = cluster.node(1).popen(
            [*me, "writer", name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        rss: list[dict[str, int]] = []
        placed: list[int] = []
        while len(rss) < 2 * STEPS:
            record = _line(writer.stdout, "writer")
            if "step" in record:
                placed.append(record["placed_bytes"])
                driver.stdin.write("rss\n")
                driver.stdin.flush()
                rss.append(_line(driver.stdout, "driver"))
            else:
                driver.stdin.write(json.dumps(record) + "\n")
        driver.stdin.write("metrics\n")
        driver.stdin.flush()
        metrics = _line(driver.stdout, "driver")
        driver.stdin.close()
        assert driver.wait(60) == 0
        assert writer.stdin is not None
        writer.stdin.close()
        writer.wait(60)
        ten_x = sum(placed[STEPS:])
        assert ten_x >= 8 * sum(placed[:STEPS]) and ten_x > 4 * MARGIN, placed
        growth = rss[-1]["VmRSS"] - rss[STEPS - 1]["VmRSS"]
        print(f"driver RSS per step {[r['VmRSS'] >> 20 for r in rss]} MiB, placed {placed}")
        assert growth < MARGIN, f"driver RSS grew {growth >> 20} MiB over {ten_x >> 20} MiB: {rss}"
        one, two = cluster.node(1).address, cluster.node(2).address
        prefix = "knitkit/delivery/reorganizer_bytes"
        assert metrics[f"{prefix}_read_remote"] > 0 == metrics[f"{prefix}_read_local"]
        links = {k.rpartition("/")[2]: v for k, v in metrics.items() if "_by_link/" in k}
        assert set(links) == {f"{one}_to_{two}"}, links
        assert links[f"{one}_to_{two}"] >= metrics[f"{prefix}_read_remote"]


if __name__ == "__main__":
    {"driver": _driver, "writer": _writer}[sys.argv[1]](sys.argv[2])
