"""A real local Ray cluster of several raylets on this machine, for the tests that add and
remove Ray nodes (``ray.cluster_utils.Cluster``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray.cluster_utils import Cluster

from knitkit.integration.ray import loopback_only


@contextmanager
def local_cluster(**init: Any) -> Iterator[Cluster]:
    """A head node (2 CPUs) with every listener on loopback, this process connected to it
    (``ray.init(logging_level="ERROR", **init)``), shut down at the end; whatever runtime this
    process had up is shut down first. Add worker nodes inside ``loopback_only()``. Its workers
    run at niceness 0, as knitkit asks of a cluster (NOTE [ Ray workers at the trainer's
    priority ] in integration/ray/runtime.py)."""
    if ray.is_initialized():
        ray.shutdown()
    with loopback_only():
        made = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "include_dashboard": False,
                "_system_config": {"worker_niceness": 0},
            },
        )
    try:
        with loopback_only():
            ray.init(address=made.address, logging_level="ERROR", **init)
        yield made
    finally:
        ray.shutdown()
        made.shutdown()
