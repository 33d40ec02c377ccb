"""Runs one reorganizer in a process of its own; the launcher owns its slot ring and cleans up."""

from __future__ import annotations

import array
import contextlib
import fcntl
import io
import json
import mmap
import multiprocessing as mp
import os
import pickle
import queue
import select
import subprocess
import sys
import termios
import threading
import traceback
import types
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, cast

from knitkit.sigterm import sigterm_exits
from knitkit.storage.backends.backend import UnitBackend, check_backend
from knitkit.storage.backends.owner import OwnerFinalizer
from knitkit.storage.delivery.liveness import WaitSlices
from knitkit.storage.delivery.publication import heartbeat_period
from knitkit.storage.delivery.reorganizer import ReorganizerHost
from knitkit.storage.delivery.slot_ring import (
    DONE,
    STARTING,
    ConsumerDiedError,
    RingClosedError,
    RingSpec,
    SlotRing,
)
from knitkit.storage.delivery.streaming_copies import streaming_copies
from knitkit.storage.planning.plan import ConsumerPlan, EncoderRankPlan

# NOTE [ Reorganizer process shutdown ]
#
# Lifecycle table: docs/lifecycle.md.
# The launcher (this module's ReorganizerProcess, in the trainer or driver process) OWNS the ring:
# it creates it before spawning the child and unlinks it in close(). close() runs on every exit
# path: explicit close / `with`, an exception, SIGINT (KeyboardInterrupt), SIGTERM (a SystemExit
# where it was SIG_DFL: NOTE [ SIGTERM while child processes are open ] in knitkit/sigterm.py) and
# interpreter exit (the finalizer). If the launcher is SIGKILLed, its resource tracker unlinks
# the ring. close(): set STOP (the child's loop and a producer blocked on a full ring give up),
# join for `join_timeout_s`, then terminate and finally kill the child, then unlink the ring.
# The child ignores SIGINT (the launcher decides) and waits for its next assignment in one
# ``select.poll`` on its assignment pipe, which wakes it for work, at once when the launcher is
# gone (the pipe ends: the kernel closed the launcher's end) and at once when close() stops it
# (close sets STOP, then sends a stop item down the pipe); otherwise once per heartbeat period,
# to beat and to check the STOP word and the owner's role lock (NOTE [ Ring role locks ] in
# slot_ring.py; the backstop while a fork of the launcher keeps the pipe's end open). It exits
# when STOP is set, the launcher is gone or the pipe ends, so it never outlives its owner for
# long. The period is the idle period (``idle_period``, NOTE [ Heartbeat period ] in
# publication.py): HEARTBEAT_S, or the consumers' liveness timeout / 8 where the launcher passes
# it (3.75 s at 30 s; the 2 s cap of a wait on a full ring is not needed here). Measured
# (an idle ReorganizerProcess's CPU clock over 6 s, the length of a transfer.py look-ahead step;
# loaded 2-core machine): 5.7 ms with a 0.2 s ``Connection.poll`` (~0.1 ms a wake: it builds a
# selector per call) and a heartbeat thread, 3.6 ms with one 0.25 s ``Connection.poll``,
# 2.4-3.2 ms with one ``select.poll`` per 0.25 s (24 wakes; a bare ``select.poll`` loop costs
# ~45 us per wake, ~0.15 ms at load ~8, when its caches are cold), 0.3-0.6 ms paced to 2 s
# (3 wakes; a scratch run over transfer.py's workload, load 5-7, issue 31).
# Assignments travel over a pipe, not a multiprocessing queue: a spawn-context queue makes three
# named POSIX semaphores (/dev/shm/sem.mp-*) that only its finalizers remove, so every SIGKILLed
# launcher left three behind. A pipe is two descriptors the kernel closes with the process. The
# launcher writes it from a sender thread (`_Assignments`), so `submit` never blocks while the
# child is busy delivering: the child reads the next assignment between deliveries.
# Whatever ends the child's loop is written to the ring (DONE or FAILED + reason; ReorganizerHost),
# so consumers raise instead of waiting; a killed child is caught by the consumers' liveness
# check. A consumer that died holding a slot ends the child's loop the same way (FAILED, naming
# the consumer).
#
# Fork. A forked copy of the launcher (a DataLoader worker, os.fork) inherits this object, its
# finalizer and multiprocessing's exit hook. None of them may touch the launcher's reorganizer:
# the finalizer runs only in the launcher (NOTE [ Owner-only clean-up ] in backends/owner.py), so
# close() and interpreter exit in the fork do nothing; and the child process handle
# (_ReorganizerChild) is not a multiprocessing child (NOTE [ Reorganizer child without the
# launcher's main ]), so no exit hook of multiprocessing in the fork SIGTERMs or joins it.
# submit()/finish() in a fork raise, naming the owner.

# NOTE [ Reorganizer child without the launcher's main ]: a multiprocessing spawn child first
# imports its launcher's ``__main__`` module again (as ``__mp_main__``), so that what was defined
# there unpickles. A reorganizer's launcher is the user's training script, and the child needs
# knitkit and its backend only. Measured (a launcher script importing torch and megatron.core at
# its top, as a trainer does; 2-core dev box, load ~2): each spawned reorganizer took 3.7 s to
# start, 3.8 s of CPU and 369 MiB of resident memory, printed the script's import warnings again,
# and would have run any top-level code the script does not guard with ``if __name__ ==
# "__main__"``; a job starts one reorganizer per (DP, CP) group and per encoder rank. So the
# child is ``python -c`` importing only this module (``_CHILD``): its ``sys.path`` is the
# launcher's (passed on its command line, as spawn passes it), its arguments (backend, ring,
# liveness bound) arrive pickled through a pipe of its own (bytes only its launcher wrote, as
# spawn's do; a store's index makes them larger than the pipe, so the launcher's write waits
# for the child's read: bounded by START_TIMEOUT_S, and a child that exits first fails the
# start naming its exit code), and its assignment pipe's end is inherited by descriptor. What
# the launcher's ``__main__`` defines cannot be rebuilt there, so a backend of such a type fails
# in the launcher, naming the type (``_start_payload``), not as a child that dies at start.

_CLOSE = object()
"""Ends the sender thread of ``_Assignments``."""


@dataclass(frozen=True, slots=True)
class _Stop:
    """The owner's stop, after it set the ring's STOP: wakes an idle child at once."""


@dataclass(frozen=True, slots=True)
class _Assignment:
    """One mini-batch's work for one reorganizer (a backbone (DP, CP) group or an encoder rank)."""

    minibatch_id: str
    plan: ConsumerPlan | EncoderRankPlan


class _Assignments:
    """The launcher's end of a reorganizer's assignment pipe: ``put`` never blocks; it writes an
    item itself where the pipe has room for it, else hands it to a sender thread that writes in
    order (see NOTE [ Reorganizer process shutdown ], NOTE [ Assignments written in place ])."""

    def __init__(self, connection: Connection, name: str) -> None:
        self._connection = connection
        self._name = name
        self._pending: queue.SimpleQueue[memoryview | object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._queued = 0
        """Items handed to the sender thread and not yet written (``_lock``)."""
        self._room = _room(connection)
        """Bytes one item may take to be written into an empty pipe without blocking."""

    def put(self, item: _Assignment | _Stop | None) -> None:
        """Queue ``item`` (``None``: no more assignments) for the child."""
        blob = ForkingPickler.dumps(item)
        with self._lock:
            if not self._queued and len(blob) <= self._room:
                try:
                    if not _unread(self._connection):
                        self._connection.send_bytes(blob)  # an empty pipe takes it: no wait
                        return
                except OSError:  # the child is gone: what it would have read goes with it
                    return
            self._queued += 1
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._send, name=f"knitkit-reorganizer-submit-{self._name}", daemon=True
            )
            self._thread.start()
        self._pending.put(blob)

    def close(self, join_s: float) -> None:
        """End the sender (after the child stopped: a pending send fails on the closed pipe)."""
        self._pending.put(_CLOSE)
        if self._thread is not None:
            self._thread.join(join_s)
        self._connection.close()

    def _send(self) -> None:
        while (blob := self._pending.get()) is not _CLOSE:
            try:
                self._connection.send_bytes(cast(memoryview, blob))
            except OSError:  # the child is gone: what it would have read goes with it
                return
            with self._lock:
                self._queued -= 1


# NOTE [ Assignments written in place ]: ``submit`` must never block while the child is busy
# delivering, so assignments went through a sender thread: one thread wake per submit, and on
# the eager path (transfer.py: plan and submit after the step's barrier) each reorganizer's
# assignment waited for the driver's thread switches (~0.4-0.7 ms after the last submit under
# load). A write into an EMPTY pipe of at most its capacity less two pages (one item: header
# and body, each possibly starting a page) cannot block: only this end writes, and the child
# only drains. So ``put`` writes the item itself when the pipe is empty (FIONREAD) and nothing
# waits for the sender thread (which keeps the order), and hands it over otherwise. A
# reorganizer takes its assignment as soon as it is idle, so the pipe is empty at nearly every
# submit: transfer.py's driver starts no sender thread at all.
def _room(connection: Connection) -> int:
    """The largest item an empty pipe of ``connection`` takes whole: its capacity less two
    pages; -1 where the capacity cannot be read (not Linux): every item then goes through the
    sender thread."""
    try:
        return fcntl.fcntl(connection.fileno(), fcntl.F_GETPIPE_SZ) - 2 * mmap.PAGESIZE
    except (AttributeError, OSError):
        return -1


def _unread(connection: Connection) -> int:
    """Bytes written into ``connection``'s pipe that its reader has not read yet."""
    count = array.array("i", [0])
    fcntl.ioctl(connection.fileno(), termios.FIONREAD, count, True)
    return count[0]


class ReorganizerProcess:
    """A reorganizer in a process of its own, fed assignments in order; owns its slot ring."""

    def __init__(
        self,
        backend: UnitBackend,
        spec: RingSpec,
        *,
        join_timeout_s: float = 5.0,
        liveness_timeout_s: float | None = None,
    ) -> None:
        """``backend`` must pickle into a reader of the same units (shared-memory or disk);
        ``liveness_timeout_s``: the shortest ``liveness_timeout_s`` of the ring's consumers,
        which paces the child's waits (NOTE [ Heartbeat period ] in publication.py; ``None``:
        one wake per ``HEARTBEAT_S``, fit for any consumer)."""
        heartbeat_period(liveness_timeout_s)  # a bad bound fails here, not in the child
        check_backend(backend)  # in the launcher, before a child is spawned to fail on it
        self.spec = spec
        self.join_timeout_s = join_timeout_s
        payload = _start_payload(backend, spec, liveness_timeout_s)
        self.ring = SlotRing.create(spec)
        reader, writer = mp.Pipe(duplex=False)
        self._assignments = _Assignments(writer, spec.name)
        self._process = _ReorganizerChild()
        sigterm_exits.hold()  # see NOTE [ SIGTERM while child processes are open ]
        self._finalizer = OwnerFinalizer(
            self, _shutdown, self.ring, self._process, self._assignments, join_timeout_s
        )
        try:
            self._process.start(payload, reader.fileno())
        except BaseException:
            self._finalizer()
            raise
        finally:
            reader.close()  # the child's end: a dead child then fails the sender's writes
        self.ring.set_producer_pid(self._process.pid or 0)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def bytes_read(self) -> int:
        """Payload bytes the child read from its backend so far."""
        return self.ring.bytes_read

    @property
    def fill_s(self) -> float:
        """Thread CPU seconds the child spent writing micro-batches into slots so far (NOTE
        [ Fill time ] in reorganizer.py)."""
        return self.ring.fill_s

    def metrics(self) -> dict[str, float]:
        """This reorganizer's figures, cumulative since it started (sum them over a launcher's
        reorganizers):

        - ``knitkit/delivery/reorganizer_bytes_read``: payload bytes read from the backend;
        - ``knitkit/delivery/reorganizer_fill_s``: thread CPU seconds spent writing them into
          slots (NOTE [ Fill time ] in reorganizer.py);
        - ``knitkit/delivery/reorganizer_published``: micro-batches published.
        """
        return {
            "knitkit/delivery/reorganizer_bytes_read": float(self.ring.bytes_read),
            "knitkit/delivery/reorganizer_fill_s": self.ring.fill_s,
            "knitkit/delivery/reorganizer_published": float(self.ring.published),
        }

    def published(self) -> int:
        """Micro-batches the child published so far: it read their units before, and its ring's
        consumers can read them while the ring is mapped, so a replacement need not serve them
        again (see NOTE [ Reorganizer restart ] in knitkit/job)."""
        return self.ring.published

    def died(self) -> bool:
        """Whether the child is gone without finishing and without writing an error of its own
        (killed, crashed in C): a fresh reorganizer can take over. A child that wrote an error
        (a failed read, a consumer that died holding a slot) did not just die: ``failure()``."""
        if not self._finalizer.in_owner or self.ring.failed:
            return False
        code = self._exit_code()
        return code is not None and not (code == 0 and self.ring.state == DONE)

    def failure(self) -> str | None:
        """Why the child stopped serving, or ``None`` while it serves or after it finished
        normally: the error it wrote to the ring (a failed read, a consumer that died holding a
        slot), else, if it exited without one (killed, crashed), its pid and exit code. For a
        launcher that watches its reorganizers (``knitkit.job``'s driver) rather than waiting for
        a consumer to hit the error."""
        if self.ring.failed:
            return self.ring.error()
        code = self._exit_code() if self._finalizer.in_owner else None
        if code is not None and not (code == 0 and self.ring.state == DONE):
            return f"reorganizer process pid {self.pid} exited with code {code}"
        return None

    def _exit_code(self) -> int | None:
        """The child's exit code (``None`` while it runs). A child that exited before it took the
        producer's role lock leaves its ring STARTING, which no lock can tell from a slow start:
        the launcher, the one process that sees the exit, says so in the ring (NOTE [ Ring role
        locks ] in slot_ring.py), so consumers waiting for it stop at once."""
        code = self._process.exitcode
        if code is not None and self.ring.state == STARTING and not self.ring.producer_alive:
            self.ring.mark_exited_before_start()
        return code

    def submit(self, minibatch_id: str, plan: ConsumerPlan | EncoderRankPlan) -> None:
        """Queue one mini-batch's assignment; its micro-batches follow the previous ones'."""
        self._check_usable()
        self._assignments.put(_Assignment(minibatch_id, plan))

    def finish(self, timeout_s: float = 60.0) -> bool:
        """No more assignments: the child publishes what it has, marks DONE and exits.

        Waits up to ``timeout_s`` for that (its consumers must read everything first); returns
        whether the child has exited. ``close()`` stops it either way.
        """
        self._check_usable()
        self._assignments.put(None)
        self._process.join(timeout_s)
        return not self._process.is_alive()

    def close(self) -> None:
        """Stop the child (if still running) and unlink the ring; idempotent; in a forked copy
        of the launcher, nothing. See NOTE [ Reorganizer process shutdown ]."""
        self._finalizer()

    def __enter__(self) -> ReorganizerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if not self._finalizer.in_owner:
            raise RuntimeError(
                f"reorganizer {self.spec.name!r} belongs to pid {self._finalizer.pid}; this is a "
                f"forked copy (pid {os.getpid()}): start a reorganizer in this process instead"
            )
        if not self._finalizer.alive:
            raise RuntimeError(f"reorganizer {self.spec.name!r} is closed; start a new one")


_CHILD = (
    "import signal, sys, json; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "sys.path[:] = json.loads(sys.argv[1]); "
    "from knitkit.storage.delivery.reorganizer_process import _child_main; "
    "_child_main(int(sys.argv[2]), int(sys.argv[3]))"
)
"""The child's program (NOTE [ Reorganizer child without the launcher's main ]); it ignores
SIGINT from its first line (NOTE [ Reorganizer process shutdown ])."""
START_TIMEOUT_S = 300.0
"""Bound of a child's start, until it has read its arguments (its interpreter and knitkit's
imports come first): generous, for a loaded machine."""
_START_CHECK_S = 0.1
"""How often a start that waits for the child's read checks that the child lives."""


class _MainTypes(pickle.Pickler):
    """A pickler that refuses objects whose type the launcher's ``__main__`` defines."""

    def reducer_override(self, obj: Any) -> Any:
        for kind in (obj, type(obj)):
            if getattr(kind, "__module__", None) == "__main__" and isinstance(
                kind, (type, types.FunctionType)
            ):
                raise TypeError(
                    f"ReorganizerProcess: {kind.__qualname__} is defined in the launcher's "
                    "__main__ module, which a reorganizer process does not import; define it "
                    "in a module (knitkit/storage/delivery/reorganizer_process.py: "
                    "NOTE [ Reorganizer child without the launcher's main ])"
                )
        return NotImplemented


def _start_payload(backend: UnitBackend, spec: RingSpec, liveness_timeout_s: float | None) -> bytes:
    """The child's arguments, pickled; ``TypeError`` naming a type of the launcher's
    ``__main__``."""
    out = io.BytesIO()
    _MainTypes(out, pickle.HIGHEST_PROTOCOL).dump((backend, spec, liveness_timeout_s))
    return out.getvalue()


class _ReorganizerChild:
    """The reorganizer's process, started by its launcher (NOTE [ Reorganizer child without
    the launcher's main ]); the ``multiprocessing.Process`` calls ``ReorganizerProcess`` uses."""

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self, payload: bytes, assignments_fd: int) -> None:
        """Start the child with ``payload`` (``_start_payload``) and the read end of its
        assignment pipe; returns once the payload is in the child's pipe. A child that exits
        before it reads the payload fails the start (``RuntimeError``), one that has not read
        it within ``START_TIMEOUT_S`` too (``TimeoutError``), each naming its pid."""
        read, write = os.pipe()
        try:
            self._popen = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _CHILD,
                    json.dumps(sys.path),
                    str(read),
                    str(assignments_fd),
                ],
                pass_fds=(read, assignments_fd),
                env=streaming_copies(os.environ),
            )
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        try:
            self._send(write, memoryview(payload))
        finally:
            os.close(write)

    def _send(self, fd: int, payload: memoryview) -> None:
        """Write ``payload`` into the child's pipe, waiting in slices of ``_START_CHECK_S`` that
        end in a check that the child lives (NOTE [ Liveness checks off the poll path ] in
        liveness.py; a payload larger than the pipe waits for the child's read)."""
        assert self._popen is not None
        os.set_blocking(fd, False)
        writable = select.poll()
        writable.register(fd, select.POLLOUT)
        slices = WaitSlices(START_TIMEOUT_S, _START_CHECK_S)
        while payload:
            if slices.check_due() and self._popen.poll() is not None:
                raise RuntimeError(self._exited_before_start())
            if slices.expired:
                raise TimeoutError(
                    f"reorganizer process pid {self._popen.pid} did not read its arguments "
                    f"within {START_TIMEOUT_S:g} s of its start (its interpreter or its imports "
                    "hang)"
                )
            if writable.poll(1000 * slices.slice_s()):
                try:
                    payload = payload[os.write(fd, payload) :]
                except BrokenPipeError:  # its end closed: it exits, or has
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self._popen.wait(START_TIMEOUT_S)
                    raise RuntimeError(self._exited_before_start()) from None

    def _exited_before_start(self) -> str:
        assert self._popen is not None
        return (
            f"reorganizer process pid {self._popen.pid} exited (code {self._popen.returncode}) "
            "before it read its arguments; its output above says why"
        )

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """The exit code once it exited (minus the signal that ended it), else ``None``."""
        return None if self._popen is None else self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout)

    def terminate(self) -> None:
        if self._popen is not None:
            self._popen.terminate()

    def kill(self) -> None:
        if self._popen is not None:
            self._popen.kill()


def _shutdown(
    ring: SlotRing,
    process: _ReorganizerChild,
    assignments: _Assignments,
    join_s: float,
) -> None:
    try:
        ring.request_stop()
        if process.pid is not None and process.exitcode is None:
            with contextlib.suppress(RuntimeError):  # no new thread at interpreter exit: the
                assignments.put(_Stop())  # child then sees STOP at its next timed wake
        if process.pid is not None:
            process.join(join_s)
            if process.is_alive():
                process.terminate()
                process.join(join_s)
            if process.is_alive():
                process.kill()
                process.join()
        assignments.close(join_s)
        ring.close()
        ring.unlink()
    finally:
        sigterm_exits.release()


def _child_main(payload_fd: int, assignments_fd: int) -> None:
    """The child's entry: read its arguments, then serve (``_CHILD``)."""
    with open(payload_fd, "rb") as pipe:
        backend, spec, liveness_timeout_s = pickle.load(pipe)
    _serve(backend, spec, Connection(assignments_fd, writable=False), liveness_timeout_s)


def _serve(
    backend: UnitBackend, spec: RingSpec, assignments: Connection, liveness_timeout_s: float | None
) -> None:
    host = ReorganizerHost(backend, spec, beat_thread=False, liveness_timeout_s=liveness_timeout_s)
    pipe = select.poll()  # one poll object: Connection.poll builds a selector per call
    pipe.register(assignments.fileno(), select.POLLIN)
    period_ms = round(host.idle_s * 1000)
    closed = f"ring {spec.name!r} closed by its owner"
    try:
        while True:
            woken = pipe.poll(period_ms)  # see NOTE [ Reorganizer process shutdown ]
            if host.abandoned:
                host.fail(closed)
                return
            if not woken:  # the period passed: beat
                host.beat_idle()
                continue
            try:
                item = assignments.recv()
            except EOFError:  # the launcher closed (or lost) its end
                item = _Stop()
            if isinstance(item, _Assignment):
                host.deliver(item.minibatch_id, item.plan)
            elif item is None:
                host.finish()
                return
            else:  # the owner's stop: it set STOP first, and no wait is left to see it
                host.fail(closed)
                return
    except (RingClosedError, ConsumerDiedError):
        return  # the host wrote the reason to the ring; nothing else to report
    except BaseException:
        host.fail(f"reorganizer pid {os.getpid()} failed:\n{traceback.format_exc()}")
        raise
    finally:
        host.close()
        backend.close()
