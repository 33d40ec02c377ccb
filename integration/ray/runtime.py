"""Start a Ray runtime for knitkit: loopback-only on one node unless an address is given.

NOTE [ Ray loopback runtime ]: Ray 2.60 resolves a node address of ``127.0.0.1`` to the host's
LAN address (``services.resolve_ip_for_localhost`` -> ``get_node_ip_address``, in the process
that starts the node) and then binds gcs_server, raylet, core workers and the dashboard and
runtime-env agents to it or to ``0.0.0.0``/``::``, even with ``include_dashboard=False`` (11 of
12 listeners off loopback). Given ``127.0.0.1`` unresolved, every one of them binds loopback: the
node's processes take the address from their command line, not from their environment. Ray has
no public knob for "do not resolve": the resolution consults the private constant
``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` (set at import from
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``), and only while no node is attached to the process. So
``loopback_only`` switches that constant off around the node's start, and nothing else: no
environment variable, no process-wide hook. The switch is confined: a process-wide count under
a lock (the first caller in saves the value, the last one out puts it back, so nested or
concurrent starts restore it once and correctly), restored on every exit path, and a no-op when
the constant is already off (the user exported the variable). While it is off, another thread
asking Ray for this node's address before a node is attached gets ``127.0.0.1``. Not chosen:
starting the head with the public ``ray start --head --node-ip-address=127.0.0.1`` CLI (the
variable in its own environment) and joining it, because ``ray.shutdown()`` would then leave
the runtime running. A process that exports ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before
importing Ray needs no switch at all.
The rest of what a caller sees is Ray's own: ``start_ray`` leaves ``os.environ`` exactly as
``ray.init`` with the same options leaves it, and importing ``knitkit.integration.ray`` does not
import Ray (``import ray`` alone sets ``RAY_CLIENT_MODE`` in ``os.environ``): the package loads
its Ray-using modules on first use. Tests: ``tests/test_side_effects.py``,
``tests/integration/test_listeners.py``. Process-wide state knitkit touches: docs/lifecycle.md.

NOTE [ Ray workers at the trainer's priority ]: Ray runs every worker process (tasks and actors)
at niceness 15 (its ``worker_niceness``), so the driver stays responsive under a flood of
tasks. knitkit's actors are the data path: reorganizers, control relays, TransferQueue's
controller and storage units. Beside CPU-bound processes at niceness 0 (the trainer's ranks),
a nice-15 process gets about 1/30 of a contended core (weights 36 against 1024), and the data
path waits for them: on the 2-core dev box beside two busy loops, TransferQueue's storage-unit
actors were still importing torch after 3 minutes (their start, bounded at 300 s, ran past
pytest's timeout), and the simulated cluster's lost-node test took 242 s against 19 s idle;
at niceness 0, beside the same loops, the module passed (its start 17 s) and that test took 26 s.
knitkit's own reorganizer processes (``ReorganizerProcess``) run at their launcher's niceness;
so ``start_ray`` starts Ray's workers at niceness 0 too (``_system_config``'s
``worker_niceness``; a caller's own value wins). A cluster the user starts keeps Ray's default:
start it with ``RAY_worker_niceness=0`` in every node's environment where knitkit's actors
share cores with the trainer (knitkit.testing's simulated cluster does); a ``RayDispatcher``
whose reorganizers run behind its own process's niceness warns once (``RuntimeWarning``),
naming them and the fix. Not chosen: the actors lowering their own niceness (it needs
``CAP_SYS_NICE``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from knitkit.integration.loopback import LOOPBACK, is_loopback

_switch_lock = threading.Lock()
_switched = 0
"""Callers inside ``loopback_only`` now."""
_saved_cluster_flag = True


def start_ray(*, node_ip_address: str | None = None, **options: Any) -> None:
    """``ray.init`` a new single-node runtime in this process, every listener on loopback.

    ``node_ip_address`` is the knob for multi-node use: give this node's reachable address to
    start a head other nodes can join (Ray then listens on all interfaces). ``options`` go to
    ``ray.init`` (``num_cpus``, ``logging_level``, ...); the dashboard stays off, and Ray's
    workers run at this process's niceness, not Ray's 15 (NOTE [ Ray workers at the trainer's
    priority ]). To join an existing cluster call ``ray.init(address=...)`` yourself. See
    NOTE [ Ray loopback runtime ].
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
    # workers at niceness 0: NOTE [ Ray workers at the trainer's priority ]
    options["_system_config"] = {"worker_niceness": 0, **options.get("_system_config", {})}
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

    See NOTE [ Ray loopback runtime ] for what it switches, and for how long.
    """
    from ray._private import ray_constants

    global _switched, _saved_cluster_flag
    with _switch_lock:
        if _switched == 0:
            _saved_cluster_flag = ray_constants.ENABLE_RAY_CLUSTER
            ray_constants.ENABLE_RAY_CLUSTER = False
        _switched += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switched -= 1
            if _switched == 0:
                ray_constants.ENABLE_RAY_CLUSTER = _saved_cluster_flag
