"""knitkit's Ray actors are the data path and run at the trainer's priority (NOTE [ Ray workers at
the trainer's priority ] in integration/ray/runtime.py): a ``RayDispatcher`` whose reorganizer
actors run niced behind the driver says so, naming the fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="the Ray integration needs ray (pip install knitkit[ray])")

_NICED = """
import json, warnings
import ray
from knitkit.integration.ray import RayBackend, RayDispatcher, RingConfig, start_ray
from knitkit.storage import Topology

start_ray(num_cpus=1, logging_level="ERROR", _system_config={"worker_niceness": 15})
backend = RayBackend()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dispatcher = RayDispatcher(backend, Topology(1), ring=RingConfig(num_slots=1, slot_bytes=1 << 16))
niceness = ray.get(ray.remote(lambda: __import__("os").nice(0)).remote())
dispatcher.close()
backend.close()
print(json.dumps({"niceness": niceness, "warnings": [
    str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
]}), flush=True)
ray.shutdown()
"""


def test_reorganizer_actors_niced_behind_the_driver_are_named_with_the_fix() -> None:
    """A runtime whose workers run at niceness 15 (Ray's default; ``start_ray`` keeps a caller's
    own ``worker_niceness``): the dispatcher warns once, naming its group, the niceness and
    ``RAY_worker_niceness=0``. At niceness 0 it does not (tests/integration/test_ray.py)."""
    done = subprocess.run(
        [sys.executable, "-c", _NICED], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["niceness"] == 15, out
    assert len(out["warnings"]) == 1, out
    message = out["warnings"][0]
    assert "backbone/dp0/cp0" in message and "[15]" in message, message
    assert "RAY_worker_niceness=0" in message, message
