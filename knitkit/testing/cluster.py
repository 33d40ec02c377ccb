"""``SimulatedCluster``: N nodes on one machine, each with its own /dev/shm, network and raylet."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from knitkit.testing.fabric import Switch, node_address
from knitkit.testing.namespaces import NamespaceHolder, processes_in, unavailable_reason
from knitkit.testing.raylets import RAY_ENV, start_ray


@dataclass(frozen=True, slots=True)
class LinkBytes:
    """Bytes a node's link carried, each way (the kernel's interface counters)."""

    sent: int
    received: int


def _hostname(index: int) -> str:
    return f"node{index}"


class SimulatedNode:
    """One node: run commands in its namespaces; its address; its files seen from the host."""

    def __init__(self, index: int, holder: NamespaceHolder, address: str) -> None:
        self.index, self.address, self.hostname = index, address, _hostname(index)
        self.env: dict[str, str] = {}
        """Set for every command on this node (over the caller's environment)."""
        self._holder = holder
        self._started: list[subprocess.Popen[Any]] = []

    def command(self, argv: Sequence[str], *, cwd: str | None = None) -> list[str]:
        """``argv`` as a command that runs on this node (for a launcher of your own)."""
        return self._holder.enter(argv, cwd=cwd)

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on this node (``subprocess.Popen``'s keywords); it dies with the node
        at the latest. ``env`` is added to the caller's environment and the node's ``env``."""
        merged = {**os.environ, **self.env, **(env or {})}
        process = subprocess.Popen(self.command(argv, cwd=cwd), env=merged, **kwargs)
        self._started.append(process)
        return process

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float = 300.0,
        check: bool = True,
        capture_output: bool = False,
        input: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` on this node to its end, as ``subprocess.run`` (at most ``timeout_s``:
        then it is killed and ``subprocess.TimeoutExpired`` raised); ``check`` raises
        ``subprocess.CalledProcessError`` on a non-zero exit."""
        if capture_output:
            kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if input is not None:
            kwargs["stdin"] = subprocess.PIPE
        with self.popen(argv, env=env, cwd=cwd, **kwargs) as process:
            try:
                out, err = process.communicate(input, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                raise
        done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    @property
    def pid(self) -> int:
        """The host's pid of the node's init: PID 1 of the node, in all of its namespaces."""
        return self._holder.pid

    def kill(self) -> None:
        """Lose the node at once, as a machine that dies: SIGKILL every process on it (its
        raylet too) and free its namespaces; the other nodes run on."""
        self._holder.close()

    def link_bytes(self) -> LinkBytes:
        """Bytes through the node's link so far (its ``eth0``; loopback traffic is not counted)."""
        for line in Path(f"/proc/{self._holder.pid}/net/dev").read_text().splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                fields = counters.split()
                return LinkBytes(sent=int(fields[8]), received=int(fields[0]))
        raise RuntimeError(f"node {self.index} has no eth0 (was it killed?)")

    def path(self, inside: str) -> Path:
        """The host's view of ``inside`` as this node sees it (e.g. ``/dev/shm/x``)."""
        return Path(f"/proc/{self._holder.pid}/root") / inside.lstrip("/")

    def _reap(self, timeout_s: float) -> None:
        for process in self._started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout_s)
            if process.poll() is None:  # an nsenter whose child left the node: not ours to wait
                process.kill()
                process.wait(timeout_s)


class SimulatedCluster:
    """``nodes`` simulated machines on this one, as a context manager: each node has its own
    mount namespace with a private tmpfs on ``/dev/shm`` (and on ``/tmp/ray``), its own network
    namespace with one address (``node(i).address``), and with ``ray=True`` a raylet of one Ray
    cluster whose head is node 0 (``ray_address``; every node's commands get ``RAY_ADDRESS``).
    ``link_cap_mbit`` caps each node's link, each way. Needs root, ``unshare``, ``nsenter``,
    ``ip`` (and ``tc`` for a cap): ``unavailable_reason()`` says what is missing.

    Leaving it (also on an error, and when the process that built it dies) kills every process
    on its nodes and frees their namespaces, mounts and links: see NOTE [ Simulated node
    lifetime ] in namespaces.py.
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Sizes and bounds of every node."""

        shm_mb: int = 512
        """Size limit of each node's ``/dev/shm`` (a tmpfs: pages are used only once written)."""
        ray_cpus: int = 1
        """CPUs each raylet offers (``ray start --num-cpus``)."""
        object_store_mb: int = 128
        """Each raylet's object store, inside the node's ``/dev/shm`` (Ray's minimum is 75)."""
        ray_port: int = 6379
        """The head's GCS port (per node: ports are not shared between nodes)."""
        start_timeout_s: float = 300.0
        """Bound of the whole start (Ray start-up is slow on a loaded machine)."""

    def __init__(
        self,
        nodes: int = 2,
        link_cap_mbit: float | None = None,
        *,
        ray: bool = True,
        config: Config | None = None,
    ) -> None:
        self.config = config or SimulatedCluster.Config()
        if nodes < 1:
            raise ValueError(f"nodes={nodes}: a cluster has at least one node")
        if ray and self.config.object_store_mb >= self.config.shm_mb:
            raise ValueError(
                f"object_store_mb={self.config.object_store_mb} must be below shm_mb="
                f"{self.config.shm_mb}: the object store lives in the node's /dev/shm"
            )
        reason = unavailable_reason(tc=link_cap_mbit is not None)
        if reason is None and ray and importlib.util.find_spec("ray") is None:
            reason = "ray=True needs Ray installed (pip install 'knitkit[ray]')"
        if reason is not None:
            raise RuntimeError(reason)
        self._nodes: list[SimulatedNode] = []
        self._holders: list[NamespaceHolder] = []
        self._switch: Switch | None = None
        self._closed = False
        self.ray_address: str | None = None
        """The head's ``host:port`` with ``ray=True``."""
        try:
            self._start(nodes, link_cap_mbit, ray)
        except BaseException:
            self.close()
            raise

    def _start(self, count: int, cap_mbit: float | None, ray: bool) -> None:
        timeout_s = self.config.start_timeout_s
        self._switch = Switch(timeout_s=timeout_s)
        os.makedirs("/tmp/ray", exist_ok=True)  # the mount point of each node's private one
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{node_address(i)} {_hostname(i)}\n" for i in range(count)
        )
        flags = ["--mount", "--propagation", "private", "--uts", "--net", "--pid", "--mount-proc"]
        for i in range(count):
            setup = (
                f"mount -t tmpfs -o size={self.config.shm_mb}m knitkit-node-shm /dev/shm"
                # the node's /etc/hosts: a file on no disk (unlinked, kept by its bind mount)
                f" && printf '{hosts}' > /dev/shm/.hosts && mount --bind /dev/shm/.hosts /etc/hosts"
                f" && rm /dev/shm/.hosts && hostname {_hostname(i)}"
                " && mount -t tmpfs -o size=256m knitkit-node-ray /tmp/ray && ip link set lo up"
            )
            holder = NamespaceHolder(f"node {i}", flags, setup, timeout_s=timeout_s)
            self._holders.append(holder)
            address = self._switch.connect(holder, i, cap_mbit)
            self._nodes.append(SimulatedNode(i, holder, address))
        if ray:
            for node in self._nodes:
                node.env.update(RAY_ENV)
            self.ray_address = start_ray(
                [(n.popen, n.address) for n in self._nodes],
                port=self.config.ray_port,
                num_cpus=self.config.ray_cpus,
                object_store_mb=self.config.object_store_mb,
                timeout_s=timeout_s,
            )
            for node in self._nodes:
                node.env["RAY_ADDRESS"] = self.ray_address

    @property
    def nodes(self) -> tuple[SimulatedNode, ...]:
        return tuple(self._nodes)

    def node(self, index: int) -> SimulatedNode:
        """Node ``index`` (node 0 holds the Ray head)."""
        if not 0 <= index < len(self._nodes):
            raise IndexError(f"node {index}: the cluster has nodes 0..{len(self._nodes) - 1}")
        return self._nodes[index]

    @property
    def namespaces(self) -> frozenset[str]:
        """Every namespace the cluster made (``"net:[…]"``, ``"mnt:[…]"``, ``"pid:[…]"``)."""
        holders = [*self._holders, *([self._switch.holder] if self._switch else [])]
        return frozenset().union(*(h.namespaces for h in holders))

    def leftovers(self) -> dict[int, str]:
        """Processes still in (or holding) one of the cluster's namespaces: empty once closed."""
        return processes_in(self.namespaces)

    def close(self, timeout_s: float = 30.0) -> None:
        """Kill every node (all its processes at once, Ray's included), then the switch; reap
        what was started. Idempotent; see NOTE [ Simulated node lifetime ]."""
        if self._closed:
            return
        self._closed = True
        for holder in self._holders:
            holder.close(timeout_s)
        for node in self._nodes:
            node._reap(timeout_s)
        if self._switch is not None:
            self._switch.close()

    def __enter__(self) -> SimulatedCluster:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
