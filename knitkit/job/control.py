"""The driver's control channels as a seam: its schedule out to ranks, each group's write-backs in."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from knitkit.job.records import Record, RecordReader, RecordWriter
from knitkit.job.spec import group_name
from knitkit.storage import RingSpec, Topology, UnitBackend
from knitkit.storage.delivery import ConsumerClosedError, Producer

# NOTE [ Control across nodes ]: the job's control records (NOTE [ Records over slot rings ] in
# records.py) travel between the driver and ranks through a ``ControlPlane``. ``LocalControl``,
# the default, keeps today's rings in the driver node's /dev/shm: every rank must share it.
# ``knitkit.integration.ray.RayControl`` reaches ranks on any node of a Ray cluster, on the
# engine the job already runs rather than a transport of knitkit's own: one relay actor per node
# that hosts ranks creates that node's schedule ring (read by that node's ranks only, in rank
# order: ``RankSpec.schedule_of``), the driver sends every schedule record to every relay in
# order, and each relay republishes it into its ring; the relay reads the write-back rings its
# node's writer ranks create, places their outputs on its node (NOTE [ Write-backs stay on the
# writer's node ] in write_back.py) and the driver pulls those records from it. The rank side is the
# same code on every node: ``RankHandle`` reads rings on its own node and never imports an
# engine. The guarantees of the local rings hold end to end: same serving order on every rank
# (one sender, per-caller call order kept by each relay and checked by a sequence number),
# bounded memory (a bounded number of calls in flight per relay, bounded queues, the rings'
# slots), bounded waits (a dead relay or node fails the job naming it, ``NodeFailedError``),
# errors carried both ways (the driver's failure fails every node's ring; a writer rank's error,
# death or departure reaches the driver as a ``RankFailedError``), and no unpickling of bytes
# knitkit wrote: a record crosses as a JSON header string and named numpy arrays.


class ScheduleSink(Protocol):
    """Driver -> every rank: one record per (mini-batch, pass), in serving order."""

    @property
    def published(self) -> int:
        """Records sent so far."""
        ...

    @property
    def readers(self) -> int:
        """Ranks that read the schedule (the job's world size)."""
        ...

    def readers_attached(self) -> int:
        """Ranks attached to the schedule now."""
        ...

    def send(
        self, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None
    ) -> None:
        """Publish one record to every rank; blocks (bounded by the ranks' progress) while a ring
        is full; ``stop`` releases it."""
        ...

    def finish(self) -> None:
        """No more records: every rank's ``passes()`` ends after the last one."""
        ...

    def fail(self, message: str) -> None:
        """Every rank raises ``DriverFailedError`` carrying ``message``."""
        ...

    def stop(self) -> None:
        """Make a blocked ``send`` give up (any thread)."""
        ...


class WriteBackSource(Protocol):
    """One (DP, CP) group's writer rank -> the driver: its records, in order."""

    def attach(self) -> None:
        """Find the writer rank's ring: ``RingNotReadyError`` while it has not created it,
        ``ConsumerClosedError`` once closed."""
        ...

    def next(self, timeout_s: float) -> Record | None:
        """The next record, ``None`` once the writer finished; ``ReorganizerError`` (its
        failure), ``ReorganizerDiedError`` (it died), ``ConsumerClosedError`` (closed)."""
        ...

    def close(self) -> None:
        """Release a ``next`` waiting in another thread at once."""
        ...


@dataclass(frozen=True, slots=True)
class ScheduleRings:
    """Where ranks read the schedule (``RankSpec``'s ``schedule``, ``nodes``, ``schedules``)."""

    schedule: RingSpec
    nodes: tuple[str, ...] = ()
    schedules: Mapping[str, RingSpec] = field(default_factory=dict)


class Control(Protocol):
    """An open control plane: the schedule sink and one write-back source per group."""

    @property
    def schedule(self) -> ScheduleSink: ...

    @property
    def write_back(self) -> Mapping[str, WriteBackSource]:
        """One source per (DP, CP) group."""
        ...

    @property
    def rings(self) -> ScheduleRings:
        """Where ranks read the schedule."""
        ...

    def check(self) -> None:
        """Raise what broke the control path (``NodeFailedError`` naming the node); no wait."""
        ...

    def diagnose(self, error: BaseException) -> BaseException:
        """The error the job fails with when one of its parts raised ``error``: the node's
        ``NodeFailedError`` if the part failed because its node was lost (found within a
        bound: NOTE [ One error for a lost node ]), else ``error``."""
        ...

    def close(self) -> None:
        """Close every channel and free its rings; bounded, idempotent."""
        ...


@runtime_checkable
class NodeAware(Protocol):
    """A part of the job with actors on several nodes (``RayDispatcher``): told of a node the
    driver lost, it waits for nothing there again (NOTE [ One error for a lost node ])."""

    def node_lost(self, node: str) -> None:
        """``node`` (``NodeFailedError.node``) is gone, with everything of this part on it."""
        ...


@dataclass(frozen=True, slots=True)
class ControlLayout:
    """What the driver asks of its control plane (sizes from ``Driver.Config``)."""

    world_size: int
    schedule_slots: int
    schedule_slot_bytes: int
    write_back: Mapping[str, RingSpec]
    """Per (DP, CP) group: the ring its writer rank creates."""
    liveness_timeout_s: float
    units: UnitBackend | None = None
    """The store's backend: a lost node's units are named (and marked lost) in it."""
    topology: Topology | None = None
    """The job's backbone topology (where each group's writer rank is: ``writer_ranks``)."""
    pipeline: int = 1
    """Pipeline stages."""
    passes: tuple[str, ...] = ()
    """The passes' names, in order."""


class ControlPlane(Protocol):
    """How the driver reaches its ranks (see NOTE [ Control across nodes ])."""

    def open(self, layout: ControlLayout) -> Control:
        """The channels of one driver, ready for ranks to attach once this returns."""
        ...


class LocalWriteBack:
    """A group's write-back ring in this node's /dev/shm, read here (``WriteBackSource``)."""

    def __init__(self, group: str, spec: RingSpec, liveness_timeout_s: float) -> None:
        self.group, self.spec = group, spec
        self.liveness_timeout_s = liveness_timeout_s
        self._reader: RecordReader | None = None
        self._closed = False
        self._lock = threading.Lock()

    def attach(self) -> None:
        with self._lock:
            if self._closed:
                raise ConsumerClosedError(f"the write-back source of {self.group} is closed")
            if self._reader is None:
                self._reader = RecordReader(
                    self.spec,
                    0,
                    producer=writer_rank(self.group),
                    liveness_timeout_s=self.liveness_timeout_s,
                )

    def next(self, timeout_s: float) -> Record | None:
        reader = self._reader
        if reader is None:
            raise ConsumerClosedError(f"the write-back source of {self.group} is not attached")
        return reader.next(timeout_s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._reader is not None:
                self._reader.close()


def writer_ranks(topology: Topology, pipeline: int) -> dict[str, int]:
    """Each (DP, CP) group's writer rank (TP 0 of the last pipeline stage) where ranks are
    numbered in Megatron's default order: TP fastest, then CP, then DP, then stage."""
    first = (pipeline - 1) * topology.dp * topology.cp
    return {
        group_name(d, c): (first + d * topology.cp + c) * topology.tp
        for d in range(topology.dp)
        for c in range(topology.cp)
    }


def writer_rank(group: str) -> Producer:
    """How a write-back reader's errors name its producer."""
    return Producer(f"writer rank of {group}", "its rank's log says why")


@dataclass(slots=True)
class LocalChannels:
    """``LocalControl``'s channels: the schedule ring and the write-back rings, on this node."""

    schedule: RecordWriter
    write_back: dict[str, LocalWriteBack]
    rings: ScheduleRings

    def check(self) -> None:
        """Nothing to check: the rings report their own peers."""

    def diagnose(self, error: BaseException) -> BaseException:
        """One node: no node to lose."""
        return error

    def close(self) -> None:
        for source in self.write_back.values():
            source.close()
        self.schedule.close()


class LocalControl:
    """The default ``ControlPlane``: every ring in this node's /dev/shm, so ranks must run on
    the driver's node and share its /dev/shm (containers: ``--ipc=host``)."""

    def open(self, layout: ControlLayout) -> LocalChannels:
        ring = RingSpec.new(
            num_slots=layout.schedule_slots,
            slot_bytes=layout.schedule_slot_bytes,
            num_consumers=layout.world_size,
        )
        schedule = RecordWriter(
            ring, owns_ring=True, role="the driver", liveness_timeout_s=layout.liveness_timeout_s
        )
        sources = {
            group: LocalWriteBack(group, spec, layout.liveness_timeout_s)
            for group, spec in layout.write_back.items()
        }
        return LocalChannels(schedule, sources, ScheduleRings(ring))
