"""Namespace holders: one init process per simulated node (or switch) that its namespaces live by."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

# NOTE [ Simulated node lifetime ]: a node's namespaces (mount, network, PID) exist only as long
# as a process is in them; nothing pins them (no bind mount of /proc/<pid>/ns/*, no `ip netns`
# file), so the kernel frees them, with their tmpfs mounts and veth ends, when the last process
# leaves. Each node has one holder: `unshare --fork --kill-child` whose child is PID 1 of the
# node's PID namespace, a reaper that sets up nothing itself and waits. Every process started on
# the node (`nsenter --pid`) and every daemon it forks (Ray's raylet, reparented to PID 1) is in
# that PID namespace, so the kernel SIGKILLs them all when PID 1 dies. The chain that kills PID 1:
# - `close()` SIGKILLs it (no graceful `ray stop`: a test cluster keeps nothing worth flushing);
# - the process that built the cluster dies, even by SIGKILL: `unshare` was started with
#   PR_SET_PDEATHSIG=SIGKILL, so it dies too, and `--kill-child` SIGKILLs PID 1. The death signal
#   follows the *thread* that started `unshare`: build a cluster in a thread that outlives it.
# `unshare` ignores SIGTERM while it waits for its child, so SIGTERM to it does nothing; SIGKILL
# its child. The switch namespace has no PID namespace: its only process is its holder's child.
# `processes_in` finds anything still inside a node's namespaces (tests check it is empty).

_PR_SET_PDEATHSIG = 1

_REAPER = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
sys.stdout.write("ready\\n")
sys.stdout.flush()
quiet = os.open(os.devnull, os.O_WRONLY)
os.dup2(quiet, 1)
os.dup2(quiet, 2)  # the builder closes its pipes: a later write must not kill the node
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    signal.sigwait({signal.SIGCHLD})
"""
"""PID 1 of a node: reaps orphans (Ray's daemons) so none lingers as a zombie; SIGCHLD stays
pending while it reaps, so no exit is missed between a reap and the wait."""

REQUIRED_TOOLS = ("unshare", "nsenter", "ip")


def unavailable_reason(*, tc: bool = False) -> str | None:
    """Why a simulated cluster cannot run here (not root, a tool missing, no namespaces), or
    ``None``; tests skip with it."""
    if not sys.platform.startswith("linux"):
        return f"simulated clusters need Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "simulated clusters need root (mount and network namespaces, veth, tc)"
    missing = [t for t in (*REQUIRED_TOOLS, *(("tc",) if tc else ())) if shutil.which(t) is None]
    if missing:
        return f"simulated clusters need {', '.join(missing)} (util-linux, iproute2) on PATH"
    probe = subprocess.run(
        ["unshare", "--mount", "--net", "--pid", "--fork", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"this kernel refuses new namespaces: {probe.stderr.strip()}"
    return None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class NamespaceHolder:
    """One ``unshare`` whose child holds fresh namespaces (see NOTE [ Simulated node lifetime ]);
    ``setup`` (a shell line) runs inside them first."""

    def __init__(
        self, name: str, flags: Sequence[str], setup: str, *, timeout_s: float = 60.0
    ) -> None:
        self.name = name
        self._flags = [f for f in ("--mount", "--uts", "--net", "--pid") if f in flags]
        script = f'{setup} && exec "$0" -c "$1"'
        argv = ["unshare", *flags, "--fork", "--kill-child", "--", "sh", "-c", script]
        self._unshare = subprocess.Popen(
            [*argv, sys.executable, _REAPER],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        assert self._unshare.stdout is not None and self._unshare.stderr is not None
        try:
            ready, _, _ = select.select([self._unshare.stdout], [], [], timeout_s)
            line = self._unshare.stdout.readline() if ready else b""
            if line != b"ready\n":
                self._unshare.kill()
                _, err = self._unshare.communicate(timeout=timeout_s)
                raise RuntimeError(
                    f"{name}: its namespaces were not set up within {timeout_s} s "
                    f"(setup: {setup!r}): {err.decode(errors='replace').strip() or 'no output'}"
                )
            self.pid = _only_child(self._unshare.pid)
            self.namespaces = namespace_ids([self.pid], kinds=_kinds(flags))
        except BaseException:
            self._unshare.kill()  # its child follows (--kill-child)
            self._unshare.wait(timeout_s)
            raise
        finally:
            self._unshare.stdout.close()
            self._unshare.stderr.close()

    def enter(self, argv: Sequence[str], *, pid: bool = True, cwd: str | None = None) -> list[str]:
        """``argv`` run inside the holder's namespaces (``nsenter``); ``pid=False`` stays out of
        its PID namespace (a command that must not die with it)."""
        flags = [f for f in self._flags if pid or f != "--pid"]
        where = [f"--wd={cwd or os.getcwd()}"] if "--mount" in flags else []
        return ["nsenter", f"--target={self.pid}", *flags, *where, "--", *argv]

    def close(self, timeout_s: float = 30.0) -> None:
        """SIGKILL the holder's child (so every process in its PID namespace) and reap."""
        if self._unshare.poll() is None:  # while unshare lives, its child's pid is not reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        try:
            self._unshare.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._unshare.kill()
            self._unshare.wait(timeout_s)


def _kinds(flags: Sequence[str]) -> tuple[str, ...]:
    names = {"--mount": "mnt", "--uts": "uts", "--net": "net", "--pid": "pid"}
    return tuple(names[f] for f in flags if f in names)


def _only_child(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    if len(children) != 1:
        raise RuntimeError(f"unshare (pid {pid}) has children {children}, expected exactly one")
    return int(children[0])


def namespace_ids(pids: Iterable[int], kinds: Sequence[str]) -> frozenset[str]:
    """The namespaces (``"net:[4026532…]"``) of ``pids``, of the given kinds (``net``, ``mnt``,
    ``pid``, ``uts``)."""
    return frozenset(os.readlink(f"/proc/{p}/ns/{kind}") for p in pids for kind in kinds)


def processes_in(namespaces: frozenset[str]) -> dict[int, str]:
    """Every process in, or holding a descriptor on, one of ``namespaces``: pid -> its command
    line. Empty once a cluster is fully cleaned up (the kernel then frees the namespaces)."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            links = [os.readlink(f"/proc/{pid}/ns/{k}") for k in ("net", "mnt", "pid", "uts")]
            fds = os.listdir(f"/proc/{pid}/fd")
            links += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds]
            if namespaces.intersection(links):
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                found[pid] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited while we looked
    return found


def wait_processes_gone(namespaces: frozenset[str], timeout_s: float) -> dict[int, str]:
    """Poll ``processes_in`` until it is empty or ``timeout_s`` passed; what is left."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_in(namespaces)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
