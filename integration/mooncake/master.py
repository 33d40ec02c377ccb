"""Run the ``mooncake_master`` shipped in Mooncake's wheel on 127.0.0.1, on free ports, and stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class MasterAddress:
    """Where a running Mooncake master listens."""

    rpc: str
    """``host:port`` of the master's RPC service (a client's ``master_server_addr``)."""
    http: str
    """``host:port`` of its HTTP admin service (``/health``, ``/get_all_keys``)."""


class MooncakeMaster:
    """A ``mooncake_master`` child process; use it as a context manager, or ``start``/``stop``.

    Clients connect peer to peer (``metadata_server="P2PHANDSHAKE"``), so no etcd or HTTP
    metadata service is needed besides this one process.
    """

    def __init__(
        self, host: str = "127.0.0.1", *, log_path: str | None = None, timeout_s: float = 15.0
    ) -> None:
        self.host = host
        self.log_path = log_path or os.devnull
        self.timeout_s = timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self.address: MasterAddress | None = None

    def start(self) -> MasterAddress:
        if self._process is not None:
            raise RuntimeError("this Mooncake master is already running; stop() it first")
        rpc_port, http_port = _free_port(self.host), _free_port(self.host)
        command = [
            str(binary()),
            f"--rpc_address={self.host}",
            f"--rpc_port={rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={http_port}",
            "--enable_metric_reporting=false",
            "--rpc_thread_num=2",
        ]
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self.address = MasterAddress(f"{self.host}:{rpc_port}", f"{self.host}:{http_port}")
        self._wait_healthy()
        return self.address

    def stop(self) -> None:
        """SIGTERM the master (it exits gracefully), SIGKILL it after 10 s; idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> MasterAddress:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        assert self._process is not None and self.address is not None
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                raise RuntimeError(
                    f"mooncake_master exited with code {code} at start-up; "
                    f"rerun with log_path=... to see why"
                )
            try:
                with urllib.request.urlopen(f"http://{self.address.http}/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(
            f"mooncake_master on {self.address.rpc} not healthy in {self.timeout_s}s"
        )


def binary() -> Path:
    """The ``mooncake_master`` executable inside the installed ``mooncake`` package."""
    import mooncake

    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; install Mooncake with `pip install mooncake-transfer-engine-non-cuda`"
        )
    return path


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
