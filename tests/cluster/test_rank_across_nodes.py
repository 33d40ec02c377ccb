"""The default control plane (``LocalControl``) on the simulated cluster: a rank on another
node than the driver has no ring to attach to, and says so (``RayControl`` reaches other nodes:
test_control_across_nodes.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from knitkit.testing import SimulatedCluster, unavailable_reason

HERE = Path(__file__).resolve().parent
REASON = unavailable_reason()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_a_rank_on_another_node_than_the_driver_fails_naming_the_cause() -> None:
    """With ``LocalControl`` the job's rings live in the driver node's /dev/shm, so a
    ``RankHandle`` started on another node fails at once, and its error says why: the ring is
    not in this node's /dev/shm, ranks must run on the driver's node, and ``RayControl``
    reaches other nodes (``DriverNotFoundError``). Not a hang, not a bare 'does not exist'."""
    with SimulatedCluster(2, ray=False) as cluster:
        script = [sys.executable, str(HERE / "job_node.py")]
        driver = cluster.node(0).popen(
            [*script, "driver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert driver.stdout is not None
        spec = driver.stdout.readline()
        assert spec.startswith("{"), "the driver did not start"
        error = (
            cluster.node(1)
            .run([*script, "rank"], input=spec, capture_output=True, text=True, timeout_s=120)
            .stdout.strip()
        )
        assert error.startswith("DriverNotFoundError: "), error
        assert json.loads(spec)["schedule"]["name"] in error, error
        assert "/dev/shm" in error and "node" in error.lower(), error
        assert "RayControl" in error, error
