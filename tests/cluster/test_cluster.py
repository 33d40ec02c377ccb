"""The simulated cluster: each node its own /dev/shm and network, a raylet per node, a link cap,
and nothing left behind however the cluster ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from knitkit.testing import (
    SimulatedCluster,
    processes_in,
    unavailable_reason,
    wait_processes_gone,
)

HERE = Path(__file__).resolve().parent
REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
NO_TC = unavailable_reason(tc=True) if REASON is None else REASON
WAIT_S = 60.0
"""Bound of a wait on a node's process starting: generous, for a loaded machine."""


def _host_links() -> list[str]:
    return sorted(os.listdir("/sys/class/net"))


def _node_mounts() -> list[str]:
    return [
        line for line in Path("/proc/mounts").read_text().splitlines() if "knitkit-node" in line
    ]


def test_each_node_sees_only_its_own_dev_shm() -> None:
    """A file written to /dev/shm on node 1 is there on node 1 only: not on nodes 0 and 2, not
    on the host."""
    name = f"knitkit-cluster-test-{os.getpid()}"
    with SimulatedCluster(3, ray=False) as cluster:
        cluster.node(1).run(["sh", "-c", f"echo x > /dev/shm/{name}"])
        seen = [
            node.run(["test", "-e", f"/dev/shm/{name}"], check=False).returncode == 0
            for node in cluster.nodes
        ]
        assert seen == [False, True, False]
        assert cluster.node(1).path(f"/dev/shm/{name}").read_text() == "x\n"
        assert not Path("/dev/shm", name).exists()


def test_nodes_reach_each_other_at_their_addresses_and_nothing_else() -> None:
    """Node 1 reaches a listener on node 0 at node 0's address; node 0's loopback is its own
    (node 1's 127.0.0.1 is not node 0's) and an address outside the cluster is unreachable."""
    probe = textwrap.dedent(
        """
        import socket, sys
        for host in sys.argv[1:]:
            try:
                socket.create_connection((host, 7000), timeout=10).close()
                print(host, "ok")
            except OSError as error:
                print(host, type(error).__name__)
        """
    )
    with SimulatedCluster(2, ray=False) as cluster:
        zero, one = cluster.node(0), cluster.node(1)
        assert zero.address != one.address
        server = zero.popen(
            [sys.executable, str(HERE / "stream.py"), "serve", "0.0.0.0", "7000"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None and server.stdout.readline() == "listening\n"
        out = one.run(
            [sys.executable, "-c", probe, "127.0.0.1", "192.0.2.1", zero.address],
            capture_output=True,
            text=True,
            timeout_s=60,
        ).stdout.split("\n")
        assert out[:3] == [
            "127.0.0.1 ConnectionRefusedError",
            "192.0.2.1 OSError",  # ENETUNREACH: no route leaves the cluster
            f"{zero.address} ok",
        ]


def test_ranks_on_two_nodes_form_one_torch_distributed_group() -> None:
    """One gloo rank per node, rendezvous at node 0 by its hostname: each node has its own
    hostname resolving to its address (so gloo binds the node's link, not loopback), and the
    all-reduce spans both nodes."""
    with SimulatedCluster(2, ray=False) as cluster:
        ranks = [
            node.popen(
                [sys.executable, str(HERE / "gloo_rank.py"), str(node.index), "2"],
                stdout=subprocess.PIPE,
                text=True,
            )
            for node in cluster.nodes
        ]
        outs = [rank.communicate(timeout=120)[0] for rank in ranks]
        assert [rank.returncode for rank in ranks] == [0, 0], outs
        assert outs == ["node0 3\n", "node1 3\n"]


def _throughput(cluster: SimulatedCluster, nbytes: int) -> float:
    """Bytes per second of one TCP stream from node 1 to node 0."""
    zero, one = cluster.node(0), cluster.node(1)
    server = zero.popen(
        [sys.executable, str(HERE / "stream.py"), "serve", zero.address, "7001"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stdout.readline() == "listening\n"
    before = one.link_bytes()
    one.run([sys.executable, str(HERE / "stream.py"), "send", zero.address, "7001", str(nbytes)])
    received, seconds = server.stdout.readline().split()
    server.wait(60)
    assert int(received) == nbytes
    assert one.link_bytes().sent - before.sent >= nbytes  # the payload and its TCP/IP headers
    return nbytes / float(seconds)


@pytest.mark.skipif(NO_TC is not None, reason=NO_TC or "")
def test_link_cap_limits_throughput() -> None:
    """With ``link_cap_mbit=40`` a stream between two nodes runs at no more than 40 Mbit/s
    (5 MB/s, within 20%); without a cap the same stream runs at over three times that. The
    sender's link counts every byte it sent."""
    cap_bytes_s = 40e6 / 8
    with SimulatedCluster(2, link_cap_mbit=40, ray=False) as cluster:
        capped = _throughput(cluster, 3 << 20)
    with SimulatedCluster(2, ray=False) as cluster:
        free = _throughput(cluster, 3 << 20)
    assert capped <= 1.2 * cap_bytes_s, f"{capped / 1e6:.1f} MB/s through a 5 MB/s cap"
    assert free > 3 * cap_bytes_s, f"uncapped {free / 1e6:.1f} MB/s"


def test_an_error_in_the_body_leaves_no_process_mount_or_link_behind() -> None:
    """Leaving the cluster on an error kills what ran on its nodes (a child of a command, and
    a daemon that left it), frees its namespaces and mounts, and adds no link to the host."""
    links = _host_links()
    with (
        pytest.raises(RuntimeError, match="the body failed"),
        SimulatedCluster(2, ray=False) as cluster,
    ):
        for node in cluster.nodes:
            node.popen(["sleep", "600"])
            node.run(["sh", "-c", "sleep 600 > /dev/null 2>&1 &"])  # orphaned to the node
        assert len(cluster.leftovers()) >= 2 * 3  # each node: its init and two sleeps
        raise RuntimeError("the body failed")
    assert cluster.leftovers() == {}
    assert _node_mounts() == []
    assert _host_links() == links


def test_a_killed_node_ends_alone() -> None:
    """``node(i).kill()`` ends every process on node i and frees its namespaces; the other
    node runs on."""
    with SimulatedCluster(2, ray=False) as cluster:
        one = cluster.node(1)
        sleeper = one.popen(["sleep", "600"])
        kinds = ("pid", "net", "mnt")
        namespaces = frozenset(os.readlink(f"/proc/{one.pid}/ns/{k}") for k in kinds)
        # the sleep itself, not only nsenter entering the node's mount namespace: a node killed
        # before nsenter forks into its pid namespace fails that fork (exit 1, seen at CI load)
        deadline = time.monotonic() + WAIT_S
        while "sleep 600" not in processes_in(namespaces).values():
            assert time.monotonic() < deadline, "the sleep never started on node 1"
            time.sleep(0.05)
        one.kill()
        assert sleeper.wait(30) == -signal.SIGKILL
        assert processes_in(namespaces) == {}
        assert cluster.node(0).run(["true"]).returncode == 0


def test_sigkill_of_the_builder_leaves_nothing_behind() -> None:
    """A process killed (SIGKILL) while its cluster runs takes the cluster with it: every
    process on its nodes ends and its namespaces are freed, within a bound."""
    builder = textwrap.dedent(
        """
        import json, sys
        from knitkit.testing import SimulatedCluster
        cluster = SimulatedCluster(2, ray=False)
        cluster.node(1).popen(["sleep", "600"])
        cluster.node(0).run(["sh", "-c", "sleep 600 > /dev/null 2>&1 &"])
        print(json.dumps(sorted(cluster.namespaces)), flush=True)
        sys.stdin.read()
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", builder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        namespaces = frozenset(json.loads(process.stdout.readline()))
        assert len(processes_in(namespaces)) >= 5  # two inits, switch, two sleeps
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    assert wait_processes_gone(namespaces, timeout_s=30) == {}


def test_ray_has_a_raylet_per_node_and_pinned_tasks_run_in_their_node() -> None:
    """With ``ray=True`` the Ray cluster has one alive node per simulated node, at the node's
    address; a task pinned to a node (NodeAffinity) runs in that node's namespaces: it sees
    that node's /dev/shm and network. Leaving the cluster ends every Ray process."""
    pytest.importorskip("ray")
    with SimulatedCluster(2) as cluster:
        for node in cluster.nodes:
            node.path(f"/dev/shm/marker-{node.index}").write_text("")
        nets = {n.address: os.readlink(f"/proc/{n.pid}/ns/net") for n in cluster.nodes}
        probe = [sys.executable, str(HERE / "ray_probe.py"), "120"]
        out = cluster.node(0).run(probe, capture_output=True, text=True, timeout_s=200)
        report = {entry["address"]: entry for entry in json.loads(out.stdout)}
        assert sorted(report) == sorted(nets)
        for i, node in enumerate(cluster.nodes):
            task = report[node.address]["task"]
            assert task["node_id"] == report[node.address]["node_id"]
            assert task["net"] == nets[node.address]
            assert [f for f in task["shm"] if f.startswith("marker-")] == [f"marker-{i}"]
    assert cluster.leftovers() == {}
