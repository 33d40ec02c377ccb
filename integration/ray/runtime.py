"""Start a Ray runtime for knitkit: loopback-only on one node unless an address is given.

NOTE [ Ray loopback runtime ]: Ray 2.60 resolves a node address of ``127.0.0.1`` to the host's
LAN address (``services.resolve_ip_for_localhost``) and then binds gcs_server, raylet, core
workers and the dashboard/runtime-env agents to it or to ``0.0.0.0``/``::``, even with
``include_dashboard=False`` (11 of 12 listeners off loopback). It keeps loopback only where
``ray_constants.ENABLE_RAY_CLUSTER`` is false (env ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read
at import by every Ray process): then the node address stays ``127.0.0.1`` and every server
binds it. ``start_ray`` sets that for the ``ray.init`` call (children inherit the environment,
the driver's already-imported constant is flipped) and restores both once the node is up: later
calls read the started node's address.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from knitkit.integration.loopback import LOOPBACK, is_loopback

_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def start_ray(*, node_ip_address: str | None = None, **options: Any) -> None:
    """``ray.init`` a new single-node runtime in this process, every listener on loopback.

    ``node_ip_address`` is the knob for multi-node use: give this node's reachable address to
    start a head other nodes can join (Ray then listens on all interfaces). ``options`` go to
    ``ray.init`` (``num_cpus``, ``logging_level``, ...); the dashboard stays off. To join an
    existing cluster call ``ray.init(address=...)`` yourself. See NOTE [ Ray loopback runtime ].
    """
    import ray

    address = options.pop("address", "local")
    if address != "local":
        raise ValueError(
            f"start_ray starts a new runtime, got address={address!r}; to join that cluster "
            "call ray.init(address=...) instead"
        )
    options.setdefault("include_dashboard", False)
    options.setdefault("log_to_driver", False)
    if node_ip_address is not None and not is_loopback(node_ip_address):
        ray.init(address="local", _node_ip_address=node_ip_address, **options)
        return
    dashboard_host = options.setdefault("dashboard_host", LOOPBACK)
    if not is_loopback(dashboard_host):
        raise ValueError(
            f"dashboard_host={dashboard_host!r} is off loopback on a single-node runtime; pass "
            "node_ip_address=<this node's address> for a multi-node head"
        )
    with loopback_only():
        ray.init(address="local", _node_ip_address=LOOPBACK, **options)


@contextmanager
def loopback_only() -> Iterator[None]:
    """Keep Ray's node address on loopback for nodes started inside: ``start_ray`` uses it;
    wrap ``ray.cluster_utils.Cluster`` and its ``add_node`` in it too.

    See NOTE [ Ray loopback runtime ].
    """
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_CLUSTER_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTER_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_CLUSTER_ENV, None)
        else:
            os.environ[_CLUSTER_ENV] = saved_env
