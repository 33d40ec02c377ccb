"""The simulated network: a bridge in a namespace of its own, a veth link and an address per node."""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Sequence

from knitkit.testing.namespaces import NamespaceHolder

# NOTE [ Simulated cluster network ]: each node has its own network namespace, joined by a veth
# pair to a bridge that lives in a further namespace of its own (the switch). Its addresses come
# from 198.18.0.0/15, the range reserved for benchmarking network devices (RFC 2544), and exist
# only inside these namespaces: no interface, route or address is added to the host's network
# namespace, no namespace has a default route, so nothing is sent anywhere else (a connect to
# any other address fails at once with "network unreachable"). Why not loopback aliases
# (127.0.0.2, 127.0.0.3, ... in one shared namespace), which would be simpler: every node's
# listeners would share one port space (two raylets, two Ray heads of other tests on the same
# machine, two torchrun stores on one port would collide), `tc` could only shape the one shared
# `lo`, and a wrong address would still reach a process on another "node". With a namespace per
# node a port is per node as on real machines, a wrong address fails, and the veth is the node's
# NIC: a link cap is a token bucket (`tbf`) on both of its ends (the node's egress on its
# `eth0`, its ingress on the switch's end). Every namespace is freed with its holder (see
# NOTE [ Simulated node lifetime ] in namespaces.py), and the veths with them.

SUBNET = ipaddress.IPv4Network("198.18.0.0/24")
"""Node ``i`` has address ``SUBNET[i + 1]`` on its ``eth0``."""
_BRIDGE = "knitkit-br"


def node_address(index: int) -> str:
    """Node ``index``'s address on the simulated network."""
    if not 0 <= index < SUBNET.num_addresses - 2:
        raise ValueError(f"node {index}: a simulated cluster has at most 254 nodes")
    return str(SUBNET[index + 1])


class Switch:
    """The bridge every node's link ends on, in its own network namespace."""

    def __init__(self, *, timeout_s: float = 60.0) -> None:
        setup = (
            f"ip link set lo up && ip link add {_BRIDGE} type bridge && ip link set {_BRIDGE} up"
        )
        self.holder = NamespaceHolder("switch", ["--net"], setup, timeout_s=timeout_s)
        self._timeout_s = timeout_s

    def connect(self, node: NamespaceHolder, index: int, cap_mbit: float | None) -> str:
        """Link ``node`` to the bridge (its ``eth0``, the switch's ``n<index>``), give it its
        address and, with ``cap_mbit``, a token bucket each way; returns the address."""
        address, port = node_address(index), f"n{index}"
        self._run(
            self.holder,
            f"ip link add {port} type veth peer name eth0 netns {node.pid}"
            f" && ip link set {port} master {_BRIDGE} && ip link set {port} up",
        )
        self._run(node, f"ip addr add {address}/{SUBNET.prefixlen} dev eth0 && ip link set eth0 up")
        if cap_mbit is not None:
            self._run(node, _token_bucket("eth0", cap_mbit))
            self._run(self.holder, _token_bucket(port, cap_mbit))
        return address

    def _run(self, holder: NamespaceHolder, line: str) -> None:
        argv: Sequence[str] = holder.enter(["sh", "-c", line], pid=False)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=self._timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{holder.name}: `{line}` failed: {done.stderr.strip()}")

    def close(self) -> None:
        self.holder.close()


def _token_bucket(device: str, cap_mbit: float) -> str:
    """A ``tbf`` root qdisc capping ``device``'s egress at ``cap_mbit`` (a bucket of 10 ms of
    traffic, at least 32 KiB, so a full-size GSO packet never waits on the bucket's size)."""
    if cap_mbit <= 0:
        raise ValueError(f"link_cap_mbit={cap_mbit}: give a positive rate in Mbit/s, or None")
    burst = max(int(cap_mbit * 1e6 / 8 * 0.01), 32 * 1024)
    return f"tc qdisc add dev {device} root tbf rate {cap_mbit}mbit burst {burst} latency 100ms"
