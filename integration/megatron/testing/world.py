"""Spawned torch.distributed worlds: start N ranks once, run picklable functions on all of them.

Usage (a function must be importable at module level, since ranks are spawned processes)::

    from knitkit.integration.megatron.testing import World, run_world

    def check(rank: int, scale: float) -> float:
        t = torch.full((1,), float(rank) * scale)
        dist.all_reduce(t)
        return float(t)

    assert run_world(check, 2, 1.5) == [1.5, 1.5]   # one-shot world

    with World(4) as world:                          # one world, many jobs
        world.run(check, 1.0)
        world.run(check, 2.0)

NOTE [ World lifetime and failures ]: each rank is a process of its own that initialises the default
process group once (gloo on CPU, NCCL with one GPU per rank) and then serves jobs from its inbox.
A job is ``fn(rank, *args)`` run on every rank; results come back in rank order. If any rank raises,
the others may be blocked inside a collective, so the world is torn down (terminated) and
``WorkerError`` carries every traceback that arrived; the next ``run`` spawns a fresh world. A job
that does not finish within its timeout tears the world down the same way, so nothing hangs.
A world leaves SIGTERM's disposition alone: inside a test runner a ``SystemExit`` would fail the
running test and the run would go on, where SIGTERM's default stops it. A program that owns a
world for its whole run holds knitkit's SIGTERM policy around it (``knitkit check-equivalence
--nproc``: NOTE [ SIGTERM while child processes are open ] in knitkit/sigterm.py), so a SIGTERM
leaves through its ``with World`` block, which ends the ranks.

NOTE [ Gloo worlds fork from a preloaded server ]: a spawned rank spends seconds importing torch
and megatron-core before it joins the group (about 5 s for a world of two on an idle 2-core
machine, 20 s under load), and a check or a test suite starts many worlds. Gloo worlds therefore
start their ranks from multiprocessing's fork server with torch, torch.distributed and
megatron-core imported once (``set_forkserver_preload``; a module that is not installed is
skipped): a world after the first starts in a fraction of a second. The fork server holds no
threads and no CUDA state, so forking it is as safe as spawning. Two things differ from spawn and
are put back: a rank gets the environment of the process that starts the world now, not the
fork server's from when it started, and NCCL worlds keep spawning (a GPU rank must not inherit
anything a CUDA probe at import may have set up).

NOTE [ Ranks end with their starter ]: a starter that dies without leaving ``with World`` (SIGKILL,
or SIGTERM at its default disposition: a killed test run, a cancelled CI job) used to leave every
rank running for good. An idle rank waits in ``inbox.get()`` on a queue whose write end it holds
itself, and a rank inside a job may wait in a collective for its whole timeout; a gloo rank's
parent is the fork server, which stays while its children do, so no parent-death signal reaches
it either. Each rank therefore runs one daemon thread (``knitkit-world-starter-watch``) that
waits on multiprocessing's parent sentinel: a pipe end whose other end only the starting process
holds (spawn and fork server alike), so it reads EOF exactly when the starter is gone. The thread
then says so on stderr and ends the rank with ``os._exit`` (its results have nobody to go to; a
collective it is blocked in never returns to run a handler). The fork server and multiprocessing's
resource tracker exit by themselves once the ranks are gone.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_STOP = "stop"
_READY = "ready"
_PRELOAD = ("torch", "torch.distributed", "megatron.core")
"""Imported once by the fork server that gloo ranks start from (NOTE [ Gloo worlds fork from a preloaded server ])."""
_STARTUP_S = 300.0
"""Limit for spawning a world (importing torch and joining the process group) on a loaded machine."""
_STARTER_GONE_EXIT = 3
"""Exit status of a rank whose starter died (NOTE [ Ranks end with their starter ])."""


class WorkerError(RuntimeError):
    """A rank of a spawned world raised, died, or ran past its timeout."""


def default_backend(size: int) -> str:
    """NCCL when there is a GPU for each of ``size`` ranks, else gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if gpus >= size else "gloo"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _context(backend: str) -> ForkServerContext | SpawnContext:
    """Fork-server context for gloo, spawn for NCCL (NOTE [ Gloo worlds fork from a preloaded server ])."""
    if backend == "nccl":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    return context


def _serve(
    rank: int,
    size: int,
    port: int,
    backend: str,
    environ: dict[str, str],
    inbox: Queue[Any],
    outbox: Queue[Any],
) -> None:
    _end_with_starter(rank)
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=120),
    )
    outbox.put((rank, True, _READY))
    while True:
        job = inbox.get()
        if job == _STOP:
            break
        fn, args = job
        try:
            outbox.put((rank, True, fn(rank, *args)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))


def _end_with_starter(rank: int) -> None:
    """End this rank once the process that started the world is gone (NOTE [ Ranks end with
    their starter ])."""
    starter = multiprocessing.parent_process()
    if starter is None:  # not a multiprocessing child: nothing to watch
        return

    def watch() -> None:
        multiprocessing.connection.wait([starter.sentinel])
        sys.stderr.write(
            f"knitkit world rank {rank} (pid {os.getpid()}): the process that started the world "
            f"(pid {starter.pid}) is gone; ending\n"
        )
        sys.stderr.flush()
        os._exit(_STARTER_GONE_EXIT)

    threading.Thread(target=watch, name="knitkit-world-starter-watch", daemon=True).start()


@dataclass(slots=True)
class World:
    """A reusable world of ``size`` spawned ranks with an initialised default process group."""

    size: int
    backend: str = "gloo"
    timeout_s: float = 120.0
    """Default limit for one ``run`` (spawning the world has its own, longer limit)."""
    _procs: list[BaseProcess] = field(default_factory=list)
    _inboxes: list[Queue[Any]] = field(default_factory=list)
    _outbox: Queue[Any] | None = None

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(rank, *args)`` on every rank; return the results in rank order.

        A failure or timeout tears the world down (see NOTE [ World lifetime and failures ]).
        """
        if not self._procs:
            self._start()
        assert self._outbox is not None
        for inbox in self._inboxes:
            inbox.put((fn, args))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        limit = self.timeout_s if timeout_s is None else timeout_s
        waited = 0.0
        while len(results) + len(errors) < self.size:
            try:
                rank, ok, value = self._outbox.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or waited >= limit:
                    self._terminate()
                    why = f"ranks {dead} died" if dead else f"timed out after {limit:.0f} s"
                    raise WorkerError(
                        f"{fn.__name__}: {why}; finished ranks: {sorted(results)}; "
                        + _format(errors)
                    ) from None
                continue
            if ok:
                results[rank] = value
            else:
                errors[rank] = value
                self._drain(errors, results)
                self._terminate()
                raise WorkerError(
                    f"{fn.__name__} failed on ranks {sorted(errors)}:\n{_format(errors)}"
                )
        return [results[r] for r in range(self.size)]

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        for inbox in self._inboxes:
            inbox.put(_STOP)
        for proc in self._started():
            proc.join(timeout=5)
        self._terminate()

    def _start(self) -> None:
        ctx = _context(self.backend)
        port = free_port()
        environ = dict(os.environ)
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.size)]
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(
                    rank,
                    self.size,
                    port,
                    self.backend,
                    environ,
                    self._inboxes[rank],
                    self._outbox,
                ),
                daemon=True,
            )
            for rank in range(self.size)
        ]
        for proc in self._procs:
            proc.start()
        ready: set[int] = set()
        waited = 0.0
        while len(ready) < self.size:
            try:
                rank, _, _ = self._outbox.get(timeout=1.0)
                ready.add(rank)
            except queue.Empty:
                waited += 1.0
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or waited >= _STARTUP_S:
                    self._terminate()
                    why = f"ranks {dead} died" if dead else f"not ready after {_STARTUP_S:.0f} s"
                    raise WorkerError(f"starting a world of {self.size}: {why}") from None

    def _drain(self, errors: dict[int, str], results: dict[int, Any]) -> None:
        """Collect what other ranks report shortly after a failure, so every traceback is shown."""
        assert self._outbox is not None
        try:
            while True:
                rank, ok, value = self._outbox.get(timeout=2.0)
                (results if ok else errors)[rank] = value
        except queue.Empty:
            pass

    def _started(self) -> list[BaseProcess]:
        """The ranks started so far (an exception, a SIGTERM's ``SystemExit`` among them, may stop
        ``_start`` midway)."""
        return [proc for proc in self._procs if proc.pid is not None]

    def _terminate(self) -> None:
        for proc in self._started():
            if proc.is_alive():
                proc.terminate()
            proc.join(timeout=5)
        self._procs, self._inboxes, self._outbox = [], [], None


def run_world(
    fn: Callable[..., Any],
    size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """Spawn a world of ``size`` ranks, run ``fn(rank, *args)`` on each, tear it down."""
    with World(size, backend, timeout_s) as world:
        return world.run(fn, *args)


def _format(errors: dict[int, str]) -> str:
    return "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(errors.items()))
