"""Single-node defaults listen on loopback only (issue 9, Security R6).

Each test starts one adapter's default runtime in a fresh Python process and lists the listening
TCP sockets of that process and all its descendants (psutil), so runtimes left by other tests
cannot hide or add a listener (nor can the Ray and TransferQueue probes, which run at once).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from knitkit.integration.loopback import is_loopback

psutil = pytest.importorskip("psutil")

PROBE_TIMEOUT_S = 600.0
"""Bound of one probe process (a runtime's start on a loaded machine: generous)."""
probe_timeout = pytest.mark.timeout(PROBE_TIMEOUT_S + 60)
"""Tests that run a probe get a pytest timeout above the probe's own bound, so the probe's
``TimeoutExpired`` (with its output) is what a hang reports."""

_LISTENERS = """
import json, psutil
def _listeners():
    me = psutil.Process()
    found = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.Error:
            continue
        found += [[name, c.laddr.ip, c.laddr.port] for c in conns if c.status == psutil.CONN_LISTEN]
    print("LISTENERS " + json.dumps(found), flush=True)
"""


def _start_probe(body: str) -> subprocess.Popen[str]:
    """Start ``body`` (which calls ``_listeners()`` while its runtime is up) in a fresh process."""
    script = _LISTENERS + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _listeners_in(
    probe: subprocess.Popen[str], timeout_s: float = PROBE_TIMEOUT_S
) -> list[tuple[str, str, int]]:
    """The listeners a started probe reports, once it has ended."""
    try:
        stdout, stderr = probe.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        probe.kill()
        stdout, stderr = probe.communicate()
        raise AssertionError(
            f"probe still running after {timeout_s:g} s:\n{stdout}\n{stderr}"
        ) from None
    lines = [line for line in stdout.splitlines() if line.startswith("LISTENERS ")]
    assert probe.returncode == 0 and lines, f"probe failed:\n{stdout}\n{stderr[-4000:]}"
    return [tuple(entry) for entry in json.loads(lines[-1].removeprefix("LISTENERS "))]


def _listeners_of(body: str, timeout_s: float = PROBE_TIMEOUT_S) -> list[tuple[str, str, int]]:
    """Run ``body`` in a fresh process (``_start_probe``) and return its listeners."""
    return _listeners_in(_start_probe(body), timeout_s)


_RAY_PROBE = """
import ray
from knitkit.integration.ray import start_ray
start_ray(num_cpus=1, logging_level="ERROR")
assert ray.get(ray.remote(lambda: 7).remote()) == 7
_listeners()
ray.shutdown()
"""

_TRANSFER_QUEUE_PROBE = """
from knitkit.integration.transferqueue import start_transfer_queue, stop_transfer_queue
start_transfer_queue()
_listeners()
stop_transfer_queue()
"""


@pytest.fixture(scope="module")
def runtime_probes() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The Ray and TransferQueue probes, started together (each lists only its own process
    tree, and ``start_ray`` starts a new local runtime in each), so one's start overlaps the
    other's: the two tests wait for their own; a probe whose package is missing is not started."""
    bodies = {"ray": _RAY_PROBE, "transfer_queue": _TRANSFER_QUEUE_PROBE}
    probes = {
        name: _start_probe(body)
        for name, body in bodies.items()
        if importlib.util.find_spec(name) is not None
    }
    try:
        yield probes
    finally:
        for probe in probes.values():
            if probe.poll() is None:
                probe.kill()
            probe.communicate()


def _off_loopback(listeners: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    return [entry for entry in listeners if not is_loopback(entry[1])]


def test_every_probe_bound_fits_under_its_test_timeout() -> None:
    """A test that runs a probe has its own pytest timeout, above the probe's bound (the suite's
    default, 300 s, is below it), so a slow start fails with the probe's output, not a kill."""
    probing = {
        name: fn
        for name, fn in globals().items()
        if name.startswith("test_")
        and name != test_every_probe_bound_fits_under_its_test_timeout.__name__
        and re.search(r"_listeners_(of|in)\(", inspect.getsource(fn))
    }
    assert probing
    for name, fn in probing.items():
        limits = [m.args[0] for m in getattr(fn, "pytestmark", []) if m.name == "timeout"]
        assert limits and limits[0] > PROBE_TIMEOUT_S, (name, limits, PROBE_TIMEOUT_S)


@pytest.mark.slow
@probe_timeout
def test_default_ray_runtime_listens_on_loopback_only(
    runtime_probes: dict[str, subprocess.Popen[str]],
) -> None:
    """Every listener of a Ray runtime started by ``start_ray()`` (gcs, raylet, workers,
    dashboard and runtime-env agents) is bound to loopback, and a task still runs on it."""
    pytest.importorskip("ray")
    listeners = _listeners_in(runtime_probes["ray"])
    assert len(listeners) >= 4, listeners  # gcs, raylet, driver, a worker at least
    assert _off_loopback(listeners) == []


@pytest.mark.slow
@probe_timeout
def test_default_transfer_queue_listens_on_loopback_only(
    runtime_probes: dict[str, subprocess.Popen[str]],
) -> None:
    """TransferQueue unpickles network payloads: its controller and storage units, and the Ray
    runtime ``start_transfer_queue()`` starts under them, listen on loopback only."""
    pytest.importorskip("transfer_queue")
    listeners = _listeners_in(runtime_probes["transfer_queue"])
    assert len(listeners) >= 6, listeners
    assert _off_loopback(listeners) == []


def test_ray_multi_node_needs_an_explicit_address() -> None:
    """A non-loopback dashboard on the single-node default is refused, naming the knob."""
    pytest.importorskip("ray")
    from knitkit.integration.ray import start_ray

    with pytest.raises(ValueError, match="node_ip_address"):
        start_ray(dashboard_host="0.0.0.0")
    with pytest.raises(ValueError, match=r"ray.init\(address"):
        start_ray(address="10.0.0.1:6379")


@probe_timeout
def test_mooncake_on_loopback_refuses_to_open_wildcard_listeners() -> None:
    """Single-node default: ``MooncakeBackend`` with its loopback ``local_hostname`` and no opt-in
    refuses to start, naming both wildcard listeners and the knobs, and nothing of the client
    listens afterwards (only the master, on loopback)."""
    pytest.importorskip("mooncake.store")
    listeners = _listeners_of(
        """
        from knitkit.integration.mooncake import MooncakeBackend, MooncakeMaster
        with MooncakeMaster() as address:
            try:
                MooncakeBackend(address).close()
            except ValueError as error:
                message = str(error)
                for needle in ("0.0.0.0", "'::'", "handshake", "data acceptor",
                               "allow_wildcard_listeners=True", "local_hostname="):
                    assert needle in message, (needle, message)
            else:
                raise AssertionError("MooncakeBackend started wildcard listeners without opt-in")
            _listeners()
        """
    )
    assert listeners and all(entry[0] == "mooncake_master" for entry in listeners), listeners
    assert _off_loopback(listeners) == [], listeners


@probe_timeout
def test_mooncake_opt_in_opens_exactly_the_documented_wildcard_listeners() -> None:
    """With ``allow_wildcard_listeners=True`` the master still listens on loopback only and the
    client's transfer engine opens exactly the two wildcard listeners Mooncake has no knob to
    bind (see integration/mooncake/README.md, "Listeners"): the TCP data acceptor (dual-stack
    ``::``) and the P2P handshake daemon (``0.0.0.0``). Anything else off loopback fails."""
    pytest.importorskip("mooncake.store")
    listeners = _listeners_of(
        """
        from knitkit.integration.mooncake import MooncakeBackend, MooncakeMaster
        with MooncakeMaster() as address:
            backend = MooncakeBackend(address, allow_wildcard_listeners=True)
            _listeners()
            backend.close()
        """
    )
    master = [entry for entry in listeners if entry[0] == "mooncake_master"]
    assert len(master) == 2 and _off_loopback(master) == [], listeners
    client_off = sorted(entry[1] for entry in _off_loopback(listeners))
    assert client_off == ["0.0.0.0", "::"], listeners


def test_mooncake_with_a_network_address_needs_no_opt_in() -> None:
    """A non-loopback ``local_hostname`` is the explicit multi-node address: the client starts
    without ``allow_wildcard_listeners`` (listening on the network is then the intent)."""
    pytest.importorskip("mooncake.store")
    address = _network_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address to advertise")
    from knitkit.integration.mooncake import MooncakeBackend, MooncakeMaster

    with MooncakeMaster() as master:
        MooncakeBackend(master, segment_bytes=0, local_hostname=address).close()


def _network_address() -> str | None:
    """This host's outbound IPv4 address (no packet is sent), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only selects a route
        except OSError:
            return None
        ip = str(probe.getsockname()[0])
    return None if is_loopback(ip) or ip == "0.0.0.0" else ip


def test_mooncake_client_of_a_remote_master_needs_its_own_address() -> None:
    """A client of a master on another host must be given its reachable ``local_hostname``: the
    loopback default is refused, naming the knob, before any engine starts."""
    pytest.importorskip("mooncake.store")
    from knitkit.integration.mooncake import MasterAddress, MooncakeBackend

    with pytest.raises(ValueError, match="local_hostname"):
        MooncakeBackend(MasterAddress("10.1.2.3:50051", "10.1.2.3:8080"))
