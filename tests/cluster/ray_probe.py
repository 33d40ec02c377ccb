"""Run on a simulated node: one task pinned to each alive Ray node; prints what each task saw."""

from __future__ import annotations

import json
import os
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0)
def where() -> dict[str, object]:
    """The node this task runs on, as its own namespaces see it."""
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "shm": sorted(os.listdir("/dev/shm")),
        "net": os.readlink("/proc/self/ns/net"),
    }


def main() -> None:
    ray.init(logging_level="ERROR")
    nodes = [n for n in ray.nodes() if n["Alive"]]
    pinned = [
        where.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote()
        for n in nodes
    ]
    seen = ray.get(pinned, timeout=float(sys.argv[1]))
    report = [
        {"address": n["NodeManagerAddress"], "node_id": n["NodeID"], "task": s}
        for n, s in zip(nodes, seen, strict=True)
    ]
    print(json.dumps(report))
    ray.shutdown()


if __name__ == "__main__":
    main()
