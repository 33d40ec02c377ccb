"""A Ray cluster over simulated nodes: the head on node 0, one raylet per other node."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence

RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_worker_niceness": "0",
}
"""Set on every node. Token auth off: Ray 2.60 turns it on whenever ``~/.ray/auth_token``
exists, a file other Ray users of the machine create and replace; the cluster's addresses
are reachable only from its own namespaces (NOTE [ Simulated cluster network ]). Workers at
niceness 0, as knitkit's docs ask of a cluster whose actors share cores with the trainer (NOTE
[ Ray workers at the trainer's priority ] in integration/ray/runtime.py)."""

Popen = Callable[..., subprocess.Popen[str]]
"""``SimulatedNode.popen``: argv run on one node."""


def start_ray(
    nodes: Sequence[tuple[Popen, str]],
    *,
    port: int,
    num_cpus: int,
    object_store_mb: int,
    timeout_s: float,
) -> str:
    """``ray start`` on each (popen, address) node: the head on the first, then every other at
    once joining it; returns the head's address. Raises naming the node whose start failed."""
    head = f"{nodes[0][1]}:{port}"
    common = [
        f"--num-cpus={num_cpus}",
        f"--object-store-memory={object_store_mb * 2**20}",
        "--disable-usage-stats",
    ]
    deadline = time.monotonic() + timeout_s
    first = ["--head", f"--port={port}", "--include-dashboard=false"]
    _wait_all([_start(nodes[0], first + common)], deadline, timeout_s, first=0)
    others = [_start(node, [f"--address={head}", *common]) for node in nodes[1:]]
    _wait_all(others, deadline, timeout_s, first=1)
    return head


def _start(node: tuple[Popen, str], flags: list[str]) -> subprocess.Popen[str]:
    popen, address = node
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", f"--node-ip-address={address}"]
    return popen([*argv, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_all(
    starts: Sequence[subprocess.Popen[str]], deadline: float, timeout_s: float, *, first: int
) -> None:
    for i, start in enumerate(starts, first):
        try:
            out, _ = start.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            start.kill()
            out, _ = start.communicate()
            raise TimeoutError(
                f"node {i}: `ray start` did not finish within {timeout_s} s "
                f"(raise SimulatedCluster.Config.start_timeout_s on a loaded machine):\n"
                f"{out[-3000:]}"
            ) from None
        if start.returncode != 0:
            raise RuntimeError(
                f"node {i}: `ray start` exited with {start.returncode}:\n{out[-3000:]}"
            )
