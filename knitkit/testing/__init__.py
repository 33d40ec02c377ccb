"""knitkit.testing: a simulated multi-node cluster on one machine, and a launcher run whose
timeout ends its workers too (``run_to_end``), for tests and benchmarks.

Not on the library's import path: nothing in knitkit imports it, and it imports no engine (Ray
runs as ``ray start`` commands inside the nodes).
"""

from knitkit.testing.cluster import LinkBytes, SimulatedCluster, SimulatedNode
from knitkit.testing.launch import run_to_end
from knitkit.testing.namespaces import processes_in, unavailable_reason, wait_processes_gone

__all__ = [
    "LinkBytes",
    "SimulatedCluster",
    "SimulatedNode",
    "processes_in",
    "run_to_end",
    "unavailable_reason",
    "wait_processes_gone",
]
