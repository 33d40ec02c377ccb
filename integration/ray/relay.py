"""Control across nodes on Ray: a relay actor per node that hosts ranks, and the driver's ``RayControl``."""

from __future__ import annotations

import json
import math
import queue
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import ray
from ray.actor import ActorHandle

from knitkit.job import ControlLayout, NodeFailedError, ReorganizerFailedError
from knitkit.job.control import ScheduleRings, writer_rank, writer_ranks
from knitkit.job.records import Record, RecordReader, RecordWriter
from knitkit.job.spec import group_name
from knitkit.job.write_back import WriteBackPlacer, placed_header
from knitkit.storage import MiniBatchPlan, ReorganizerDiedError, ReorganizerError, RingSpec
from knitkit.storage.delivery import ConsumerClosedError, RingNotReadyError
from knitkit.types import UnitKey

from .backend import RayBackend
from .pinning import pinned_to

# NOTE [ Ray control relays ]: how ``RayControl`` carries NOTE [ Control across nodes ] (in
# knitkit/job/control.py) over Ray. Lifecycle table: docs/lifecycle.md.
# - One ``ControlRelay`` actor per node in the placement, pinned there (NodeAffinity, not soft)
#   and owned by the driver's process, so it dies with the driver (its ranks then see its ring's
#   producer lock free: ``DriverDiedError``). It creates its node's schedule ring in its node's
#   /dev/shm under the name the driver chose (``RankSpec.schedules``) before ``open`` returns.
# - Schedule: the scheduler thread sends each record to every relay, in order, before the next
#   one (``publish`` runs in the actor's default concurrency group, one thread: Ray keeps one
#   caller's calls in order there, and each record carries its sequence number, which the
#   relay checks, so a reordering fails loudly instead of skewing ranks). At most ``in_flight``
#   calls per relay are outstanding: the sender waits on the oldest, so a relay blocked on a
#   full ring (its node's slowest rank) holds the driver back exactly as a local ring would,
#   and a relay that died is seen at the next send. ``fail``/``stop`` run in a ``control``
#   group beside a blocked ``publish``.
# - Write-backs: a relay reads the write-back rings of the groups whose writer rank (TP 0 of
#   the last stage: ``RayControl(writers=...)``, else Megatron's rank order) the placement puts
#   on its node, and only those, so raylets sharing one /dev/shm work too; a thread per group
#   hands the group's events, in order, to its assembling relay (NOTE [ Write-backs stay on
#   the writer's node ] in knitkit/job/write_back.py: itself, or one ``take`` call at a time to
#   another node's), which places a ``values`` record's outputs on its node (``RayBackend``
#   store) and queues the record, its arrays replaced by what was placed, in one bounded queue;
#   a driver thread per relay long-polls ``pull`` (``PULL_S``) and hands each record to its
#   group's collector through a bounded queue. A full queue stops the puller, then the
#   relay's reader (or its ``take`` call), then the writer rank on its ring: memory stays
#   bounded end to end. A writer rank that fails, dies or leaves, or outputs its relay cannot
#   place, reach the collector as the same error the local ring raises.
# - Death: a relay's pending ``pull`` (always one in flight) raises when its actor dies (its
#   node, its raylet or the actor lost); the scheduler's health check (``check``) then fails the
#   job with ``NodeFailedError`` naming the node and its ranks, and the failure reaches every
#   other node's ranks through their relays (``fail``). A relay that does not answer a pull
#   within ``PULL_S + call_timeout_s``, or whose connection broke (``ActorUnavailableError``:
#   Ray cannot say whether the pull ran, so its events may be lost), counts as dead: the job
#   fails loudly rather than go on with a write-back record missing. Measured on the simulated
#   cluster (tests/cluster/test_control_across_nodes.py): a killed node fails the job ~2 s
#   after the kill (the broken connection), not after Ray's node health checks.
# - Framing: a record crosses as a JSON header string and a dict of numpy arrays: Ray's own
#   serialization carries them (its workers unpickle what other workers of the cluster send, as
#   for every Ray call: a Ray cluster is one trust domain, and knitkit adds no pickled object of
#   its own); both ends decode the header with ``json.loads`` and check it (data only).

# NOTE [ One error for a lost node ]: a node's loss reaches the driver through several parts at
# about once: its relay's pull (the connection breaks, ~2 s after a kill), its reorganizers'
# ``deliver`` calls (``ReorganizerFailedError``), a writer rank's write-back. Whichever part
# fails first, the job fails with ONE error, the node's ``NodeFailedError``: it names the node,
# its ranks and the units put from it (``.node``, ``.ranks``, ``.units``), which the others
# cannot. The failing part asks the control plane (``JobCore.part_failed`` ->
# ``Control.diagnose``). A part that brings its own evidence decides at once: a reorganizer
# whose connection broke (``ReorganizerFailedError.unreachable_node``: its call ended
# ``ActorUnavailableError``, the same evidence a puller acts on) names its node's loss. Else
# ``RayChannels`` probes every relay not known lost (one call each, all at once, at most
# ``DIAGNOSE_S``) and answers the lost node's error if a probe or a puller found one, else the
# part's own error. The evidence rule closes a race the probes left open. A call submitted
# after a kill is not refused: the node's address vanished (no reset, no answer), so it waits
# for Ray's health checks (measured on the simulated cluster: the call in flight at the kill
# failed after 1.2 s, a new call to the same actor after 22 s, one to another actor of the node
# after 28 s). So when the pool saw its reorganizer's broken connection first, the diagnosis
# hung on the puller having a pull in flight at the kill; the lost-node test in
# tests/cluster/test_control_across_nodes.py failed with the pool's ``ReorganizerDied`` beside
# two busy loops and once on a quiet CI. Chosen over reporting whichever part came first (a
# handler would parse two kinds, and a reorganizer's error names no ranks or units) and over
# waiting for Ray's node health checks (15-30 s). Cost: one probe round trip on a part's
# failure (milliseconds on a healthy cluster); a relay that does not answer within the bound is
# left to its puller. Units: the directory records the node each unit was put from (its
# owner's); a node that is gone or unreachable takes them along, so ``RayBackend.drop_node``
# marks them lost in one call and later reads raise ``UnitsLostError`` naming them (NOTE [ Ray
# unit directory ] in backend.py). Resuming re-writes them: they belong to pending
# mini-batches, whose trajectories the resumed driver's ``reissue()`` names. ``close`` after a
# loss waits for nothing on the lost node: not its relay (known lost), not its reorganizers
# (the driver tells its pool, ``NodeAware.node_lost``; an actor whose call failed unreachable
# or whose node Ray lists dead counts too): neither closed nor their rings unlinked, the rings
# died with the node's /dev/shm. Before, close waited 30 s per actor there.

DIAGNOSE_S = 5.0
"""How long a part's failure waits for the relays to tell whether a node was lost (a killed
node's relay is found unreachable ~2 s after the kill: NOTE [ One error for a lost node ])."""
PULL_S = 1.0
"""How long one ``pull`` waits for write-back records before it returns empty."""
POLL_S = 0.05
"""How often a relay looks for a write-back ring its writer rank has not created yet."""
_PULL_BATCH = 64
"""At most this many events per ``pull``."""

PLAN_WAIT_S = 300.0
"""How long an assembling relay waits for the plan of a mini-batch whose outputs a group of
another node handed it (its own copy of the schedule record may be behind a full ring)."""

_Event = tuple[Any, ...]
"""("attached", group) | ("record", group, header json, arrays) | ("end", group) |
("died", group, message) | ("failed", group, message)"""


@dataclass(frozen=True, slots=True)
class _WriteBackRoles:
    """What one relay does with write-backs (see NOTE [ Write-backs stay on the writer's node ]
    in knitkit/job/write_back.py)."""

    follow: Mapping[str, RingSpec]
    """The groups whose writer rank the placement puts on its node: it reads their rings."""
    assembles: frozenset[str]
    """The groups whose events it hands the driver (placing their outputs)."""
    units: str | None
    """The job's ``RayBackend`` name; ``None``: outputs go to the driver as they came."""
    last_pass: str
    """After a group's end of this pass a mini-batch's plan is no longer needed for it."""


@ray.remote(num_cpus=0, concurrency_groups={"control": 1, "write_back": 1, "assemble": 1})  # type: ignore[call-overload]
class ControlRelay:
    """A node's end of the driver's control channels: republishes the schedule into the node's
    ring and reads the write-back rings of the writer ranks on the node (see NOTE [ Ray control
    relays ]); with a ``RayBackend`` store it places their outputs on the node (see
    NOTE [ Write-backs stay on the writer's node ] in knitkit/job/write_back.py)."""

    def __init__(
        self,
        node: str,
        address: str,
        schedule: RingSpec,
        write_back: _WriteBackRoles,
        liveness_timeout_s: float,
        queue_events: int,
    ) -> None:
        self.node, self.address = node, address
        self._writer = RecordWriter(
            schedule,
            owns_ring=True,
            role=f"the driver (through its relay on node {node})",
            liveness_timeout_s=liveness_timeout_s,
        )
        self._sequence = 0
        self._publishing = threading.Lock()
        self._events: queue.Queue[_Event] = queue.Queue(maxsize=queue_events)
        self._stopping = threading.Event()
        self._readers: dict[str, RecordReader] = {}
        self._lock = threading.Lock()
        self._liveness_timeout_s = liveness_timeout_s
        self._roles = write_back
        self._placer = (
            WriteBackPlacer(RayBackend(write_back.units, create=False))
            if write_back.units and write_back.assembles
            else None
        )
        self._plans: dict[str, MiniBatchPlan] = {}
        """Plans of the mini-batches in flight (kept only where this relay places units)."""
        self._ended: dict[str, set[str]] = {}
        """Per mini-batch: the groups placed here whose last pass ended."""
        self._planned = threading.Condition()
        self._assembling = threading.Lock()
        self._homes: Mapping[str, ActorHandle] = {}
        self._threads: list[threading.Thread] = []

    @ray.method(concurrency_group="control")
    def start(self, homes: Mapping[str, ActorHandle]) -> str:
        """Follow the write-back rings of the groups whose writer rank is on this node; a
        group in ``homes`` hands its events to that relay (its DP rank's assembling relay).
        Returns the Ray node id it runs on (once its ring exists)."""
        self._homes = dict(homes)
        self._threads = [
            threading.Thread(
                target=self._follow, args=(group, spec), name=f"knitkit-relay-{group}", daemon=True
            )
            for group, spec in self._roles.follow.items()
        ]
        for thread in self._threads:
            thread.start()
        return cast(str, ray.get_runtime_context().get_node_id())

    def publish(self, sequence: int, header: str, arrays: Mapping[str, np.ndarray]) -> None:
        """Schedule record ``sequence`` into this node's ring (blocks while it is full)."""
        with self._publishing:
            if sequence != self._sequence:
                raise RuntimeError(
                    f"relay on node {self.node}: schedule record {sequence} arrived, expected "
                    f"{self._sequence}; Ray reordered the driver's calls"
                )
            if self._placer is not None and "plan" in arrays:  # a mini-batch's first pass
                plan = MiniBatchPlan.from_json(np.asarray(arrays["plan"]).tobytes().decode())
                with self._planned:
                    self._plans[plan.minibatch_id] = plan
                    self._planned.notify_all()
            self._writer.send(_header(header), arrays)
            self._sequence += 1

    def finish(self) -> None:
        """After the last record: this node's ranks end their ``passes()``."""
        with self._publishing:
            self._writer.finish()

    @ray.method(concurrency_group="assemble")
    def take(self, event: _Event) -> bool:
        """An event of a group this relay assembles, from the relay that reads its ring on
        another node (one call at a time per group, in order; blocks while the queue is full).
        Returns whether to go on following the group."""
        return self._take(event)

    @ray.method(concurrency_group="write_back")
    def pull(self, timeout_s: float) -> list[_Event]:
        """Write-back events of this node's writer ranks, waiting at most ``timeout_s``."""
        try:
            events = [self._events.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while len(events) < _PULL_BATCH:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        return events

    @ray.method(concurrency_group="control")
    def ready(self) -> str:
        """The Ray node id it runs on (once its ring exists)."""
        return cast(str, ray.get_runtime_context().get_node_id())

    @ray.method(concurrency_group="control")
    def readers_attached(self) -> int:
        return self._writer.readers_attached()

    @ray.method(concurrency_group="control")
    def fail(self, message: str) -> None:
        """This node's ranks raise ``DriverFailedError`` carrying ``message``."""
        self._writer.fail(message)

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        """Make a ``publish`` blocked on a full ring give up."""
        self._writer.stop()

    @ray.method(concurrency_group="control")
    def close(self) -> None:
        """Stop reading and publishing, free the rings; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with self._planned:
            self._planned.notify_all()
        self._writer.stop()
        with self._lock:
            for reader in self._readers.values():
                reader.close()
        for thread in self._threads:
            thread.join(10)
        with self._publishing:  # a publish returns at once once stopped
            self._writer.close()

    def _follow(self, group: str, spec: RingSpec) -> None:
        """Find ``group``'s write-back ring on this node, then hand its records on in order."""
        reader = None
        while reader is None and not self._stopping.is_set():
            try:
                reader = RecordReader(
                    spec,
                    0,
                    producer=writer_rank(group),
                    liveness_timeout_s=self._liveness_timeout_s,
                )
            except RingNotReadyError:
                self._stopping.wait(POLL_S)
            except ValueError as error:  # e.g. another reader holds it: two jobs, one name
                self._route(("failed", group, f"relay on node {self.node}: {error}"))
                return
        with self._lock:
            if reader is None or self._stopping.is_set():
                if reader is not None:
                    reader.close()
                return
            self._readers[group] = reader
        if not self._route(("attached", group)):
            return
        while True:
            try:
                record = reader.next(math.inf)
            except ConsumerClosedError:
                return
            except ReorganizerDiedError as error:
                self._route(("died", group, str(error)))
                return
            except ReorganizerError as error:
                self._route(("failed", group, str(error)))
                return
            if record is None:
                self._route(("end", group))
                return
            if not self._route(("record", group, json.dumps(record.header), record.arrays)):
                return

    def _route(self, event: _Event) -> bool:
        """Hand ``event`` to its group's assembling relay: this one, or a call to the relay of
        another node, waited for (so the group's events stay in order and bounded). Returns
        whether to go on following the group."""
        home = self._homes.get(event[1])
        if home is None:
            return self._take(event)
        call: ray.ObjectRef = home.take.remote(event)
        while not self._stopping.is_set():
            done, _ = ray.wait([call], timeout=POLL_S * 4)
            if not done:
                continue
            try:
                return bool(ray.get(call))
            except ray.exceptions.RayError as error:
                self._put(
                    (
                        "failed",
                        event[1],
                        f"the relay on node {self.node} could not hand {event[1]}'s write-back "
                        f"to its assembling relay: {type(error).__name__}: {str(error)[:500]}",
                    )
                )
                return False
        return False

    def _take(self, event: _Event) -> bool:
        """Queue one event of a group assembled here for the driver; a ``values`` record's
        arrays are placed on this node first (see NOTE [ Write-backs stay on the writer's node
        ] in knitkit/job/write_back.py). Returns whether to go on following the group."""
        if event[0] == "record" and self._placer is not None:
            try:
                event = self._placed(event[1], event[2], event[3])
            except Exception as error:  # reaches the driver as the group's failure
                self._put(
                    (
                        "failed",
                        event[1],
                        f"the relay on node {self.node} could not place {event[1]}'s write-back "
                        f"({type(error).__name__}: {error})",
                    )
                )
                return False
        self._put(event)
        return event[0] in ("record", "attached")

    def _placed(self, group: str, text: str, arrays: Mapping[str, np.ndarray]) -> _Event:
        """``group``'s record as the driver gets it: a ``values`` record's units put here and
        its arrays replaced by what was placed; a plan dropped after its last pass ended."""
        assert self._placer is not None
        header = _header(text)
        minibatch_id = str(header.get("mb"))
        if header.get("kind") == "values":
            plan = self._plan(minibatch_id, group)
            consumer = next((c for c in plan.consumers if c.name == group), None)
            if consumer is None:
                raise ValueError(f"mini-batch {minibatch_id!r} has no consumer {group}")
            micro_batch = consumer.micro_batches[int(header["index"])]
            with self._assembling:
                placed = self._placer.take(micro_batch, arrays)
            out = placed_header(header, arrays, placed, self.address)
            return ("record", group, json.dumps(out, separators=(",", ":")), {})
        if header.get("kind") == "done" and header.get("pass") == self._roles.last_pass:
            with self._planned:
                ended = self._ended.setdefault(minibatch_id, set())
                ended.add(group)
                if ended >= self._roles.assembles:
                    self._plans.pop(minibatch_id, None)
                    del self._ended[minibatch_id]
        return ("record", group, text, arrays)

    def _plan(self, minibatch_id: str, group: str) -> MiniBatchPlan:
        """The mini-batch's plan: its first pass's schedule record carries it, which reaches
        this relay before its writer ranks' outputs, or soon after for a group of another
        node (``PLAN_WAIT_S`` at most)."""
        with self._planned:
            if not self._planned.wait_for(
                lambda: minibatch_id in self._plans or self._stopping.is_set(), PLAN_WAIT_S
            ):
                raise TimeoutError(
                    f"{group} wrote back outputs of mini-batch {minibatch_id!r}, whose plan "
                    f"(its first pass's schedule record) did not reach this relay within "
                    f"{PLAN_WAIT_S} s"
                )
            if minibatch_id not in self._plans:
                raise ConsumerClosedError("the relay is closing")
            return self._plans[minibatch_id]

    def _put(self, event: _Event) -> None:
        while not self._stopping.is_set():
            try:
                self._events.put(event, timeout=POLL_S)
                return
            except queue.Full:
                continue


def _header(text: str) -> dict[str, Any]:
    """A record's header from its JSON text (data only)."""
    header = json.loads(text)
    if not isinstance(header, dict):
        raise ValueError(f"a control record's header must be a JSON object, got {text[:200]!r}")
    return header


class RelayedWriteBack:
    """A group's write-back records as its node's relay forwards them (``WriteBackSource``)."""

    def __init__(self, group: str, spec: RingSpec, where: str) -> None:
        """``where``: the node and writer rank whose relay reads the ring (for errors)."""
        self.group, self.spec, self.where = group, spec, where
        self._events: deque[_Event] = deque()
        self._capacity = spec.num_slots
        self._cond = threading.Condition()
        self._attached = self._closed = False

    def attach(self) -> None:
        with self._cond:
            if self._closed:
                raise ConsumerClosedError(f"the write-back source of {self.group} is closed")
            if not self._attached:
                raise RingNotReadyError(
                    f"the relay on node {self.where} has not found {self.group}'s write-back "
                    f"ring {self.spec.name!r} there yet (RayControl placement and writers say "
                    "where its writer rank runs)"
                )

    def next(self, timeout_s: float) -> Record | None:
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._events or self._closed, None if math.isinf(timeout_s) else timeout_s
            ):
                raise TimeoutError(f"no write-back record of {self.group} within {timeout_s} s")
            if self._closed:
                raise ConsumerClosedError(f"the write-back source of {self.group} is closed")
            event = self._events.popleft()
            self._cond.notify_all()
        kind = event[0]
        if kind == "record":
            return Record(_header(event[2]), dict(event[3]))
        if kind == "died":
            raise ReorganizerDiedError(event[2])
        if kind == "failed":
            raise ReorganizerError(event[2])
        return None  # "end": the writer rank finished

    def put(self, event: _Event, stopping: threading.Event) -> None:
        """From a puller thread: hand one event on, waiting while ``capacity`` are queued."""
        with self._cond:
            if event[0] == "attached":
                self._attached = True
                return
            while len(self._events) >= self._capacity and not (self._closed or stopping.is_set()):
                self._cond.wait(POLL_S)
            if not self._closed:
                self._events.append(event)
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass(slots=True)
class _Relay:
    """The driver's view of one relay: its node, ranks, and outstanding schedule calls."""

    node: str
    label: str
    ranks: tuple[int, ...]
    actor: ActorHandle
    calls: deque[ray.ObjectRef] = field(default_factory=deque)

    def named(self) -> str:
        return f"node {self.label} (ranks {list(self.ranks)})"


class RelayedSchedule:
    """Driver -> every relay -> every node's ring (``ScheduleSink``)."""

    def __init__(self, channels: RayChannels, world_size: int) -> None:
        self._channels = channels
        self._relays = channels.relays
        self._world_size = world_size
        self._sent = 0
        self._stopped = threading.Event()

    @property
    def published(self) -> int:
        return self._sent

    @property
    def readers(self) -> int:
        return self._world_size

    def readers_attached(self) -> int:
        counts: list[int] = []
        for relay in self._relays:
            call: ray.ObjectRef = relay.actor.readers_attached.remote()
            try:
                counts.append(int(ray.get(call, timeout=30)))
            except (ray.exceptions.RayError, TimeoutError):
                counts.append(0)
        return sum(counts)

    def send(
        self, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None
    ) -> None:
        text = json.dumps(dict(header), separators=(",", ":"))
        payload: object = ray.put(dict(arrays)) if arrays else {}  # put once, read by each
        for relay in self._relays:
            self._room(relay)
            relay.calls.append(relay.actor.publish.remote(self._sent, text, payload))
        self._sent += 1

    def finish(self) -> None:
        for relay in self._relays:
            self._room(relay)
            relay.calls.append(relay.actor.finish.remote())

    def fail(self, message: str) -> None:
        calls: list[ray.ObjectRef] = [r.actor.fail.remote(message) for r in self._channels.live()]
        ray.wait(calls, num_returns=len(calls), timeout=30)  # so it lands before ``close``

    def stop(self) -> None:
        self._stopped.set()
        for relay in self._relays:
            relay.actor.stop.remote()

    def _room(self, relay: _Relay) -> None:
        """Forget ``relay``'s calls that ended well, then wait while ``in_flight`` are still
        outstanding (bounded by its ranks' progress); ``NodeFailedError`` if one failed or the
        relay died."""
        while relay.calls:
            full = len(relay.calls) >= self._channels.in_flight
            done, _ = ray.wait([relay.calls[0]], timeout=POLL_S * 4 if full else 0)
            if done:
                try:
                    ray.get(relay.calls.popleft())
                except ray.exceptions.RayError as error:
                    raise self._channels.lost(relay, error) from None
            elif not full:
                return
            elif self._stopped.is_set():
                raise RuntimeError(f"the schedule stopped while {relay.named()} was full")
            else:
                self._channels.check()


class RayChannels:
    """``RayControl``'s open channels: relays, their pullers, the schedule and write-back sources."""

    def __init__(self, control: RayControl, layout: ControlLayout) -> None:
        self.in_flight = control.in_flight
        self.call_timeout_s = control.call_timeout_s
        placement = control.placement
        if len(placement) != layout.world_size:
            raise ValueError(
                f"RayControl placement names {len(placement)} ranks' nodes; the job has "
                f"{layout.world_size} ranks"
            )
        alive = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        gone = sorted(set(placement) - set(alive))
        if gone:
            raise ValueError(f"RayControl placement names Ray nodes that are not alive: {gone}")
        writers = _writers(control, layout)
        units = layout.units.name if isinstance(layout.units, RayBackend) else None
        writer_node = {group: placement[rank] for group, rank in writers.items()}
        # NOTE [ Write-backs stay on the writer's node ] (knitkit/job/write_back.py): a DP
        # rank's groups are assembled by the relay of its CP 0 writer's node
        assembler = {
            group: writer_node[group_name(d, 0) if units else group]
            for group, (d, _) in _groups(layout).items()
        }
        self.relays: list[_Relay] = []
        schedules: dict[str, RingSpec] = {}
        self.write_back = {
            g: RelayedWriteBack(g, s, f"{alive[writer_node[g]]} (writer rank {writers[g]})")
            for g, s in layout.write_back.items()
        }
        self._failure: NodeFailedError | None = None
        self._lost: set[str] = set()
        """Nodes whose relay failed (``close`` does not wait for them)."""
        self._losing = threading.Lock()
        self._units = layout.units
        self._stopping = threading.Event()
        self._pullers: list[threading.Thread] = []
        try:
            for node in dict.fromkeys(placement):  # in order of first rank
                ranks = tuple(r for r, n in enumerate(placement) if n == node)
                ring = RingSpec.new(
                    num_slots=layout.schedule_slots,
                    slot_bytes=layout.schedule_slot_bytes,
                    num_consumers=len(ranks),
                )
                label = f"{alive[node]} ({node[:8]})"
                roles = _WriteBackRoles(
                    follow={g: s for g, s in layout.write_back.items() if writer_node[g] == node},
                    assembles=frozenset(g for g in layout.write_back if assembler[g] == node),
                    units=units,
                    last_pass=layout.passes[-1] if layout.passes else "",
                )
                actor = ControlRelay.options(  # type: ignore[attr-defined]
                    scheduling_strategy=pinned_to(node),
                    name=f"knitkit-relay/{ring.name}",
                ).remote(
                    label,
                    alive[node],
                    ring,
                    roles,
                    layout.liveness_timeout_s,
                    max(len(roles.assembles), 1) * 4,
                )
                self.relays.append(_Relay(node, label, ranks, actor))
                schedules[node] = ring
            by_node = {relay.node: relay.actor for relay in self.relays}
            homes = {  # per relay: where the groups it reads are assembled, if elsewhere
                relay.node: {
                    g: by_node[assembler[g]]
                    for g in layout.write_back
                    if writer_node[g] == relay.node != assembler[g]
                }
                for relay in self.relays
            }
            self._await_ready(control.start_timeout_s, homes)
        except BaseException:
            self._kill()
            raise
        self.rings = ScheduleRings(schedules[placement[0]], tuple(placement), schedules)
        self.schedule = RelayedSchedule(self, layout.world_size)
        for relay in self.relays:
            puller = threading.Thread(
                target=self._pull,
                args=(relay,),
                name=f"knitkit-relay-pull-{relay.label}",
                daemon=True,
            )
            puller.start()
            self._pullers.append(puller)

    def check(self) -> None:
        if self._failure is not None:
            raise self._failure

    def diagnose(self, error: BaseException) -> BaseException:
        """See NOTE [ One error for a lost node ]."""
        if self._failure is None and not isinstance(error, NodeFailedError):
            node = error.unreachable_node if isinstance(error, ReorganizerFailedError) else ""
            for relay in self.live():
                if relay.node == node:  # the part's own connection there broke
                    return self.lost(relay, error)
            probes: dict[ray.ObjectRef, _Relay] = {r.actor.ready.remote(): r for r in self.live()}
            done, _ = ray.wait(list(probes), num_returns=len(probes), timeout=DIAGNOSE_S)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as failed:
                    self.lost(probes[ref], failed)
        return error if self._failure is None else self._failure

    def live(self) -> list[_Relay]:
        """The relays not known to have failed."""
        return [relay for relay in self.relays if relay.node not in self._lost]

    def lost(self, relay: _Relay, error: BaseException) -> NodeFailedError:
        """The error for ``relay``'s failure (recorded once: ``check`` raises it after); a node
        that is gone or unreachable takes the units put from it along (marked lost in a
        ``RayBackend`` store, named in the error)."""
        with self._losing:
            self._lost.add(relay.node)
            if self._failure is not None:
                return self._failure
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            units: tuple[UnitKey, ...] = ()
            cut_off = True  # gone or unreachable: the units put from it are lost with it
            if relay.node not in alive:
                cause = "the node is gone"
            elif isinstance(error, ray.exceptions.ActorUnavailableError):
                cause = "its relay is unreachable (its connection broke)"
            elif isinstance(error, ReorganizerFailedError) and error.unreachable_node == relay.node:
                cause = "its reorganizer is unreachable (its connection broke)"
            else:
                cut_off = False
                died = isinstance(error, ray.exceptions.RayActorError)
                cause = "its relay actor died" if died else "its relay failed"
            if cut_off and isinstance(self._units, RayBackend):
                units = self._units.drop_node(relay.node, f"put on {relay.named()}, lost")
            owners = sorted({k.owner for k in units})
            lost = f"its ranks {list(relay.ranks)} and {len(units)} unit(s) put from it" + (
                f" (trajectories and inputs {owners[:20]}{' ...' if len(owners) > 20 else ''})"
                if owners
                else ""
            )
            self._failure = NodeFailedError(
                f"{relay.named()}: {cause} ({type(error).__name__}: {str(error)[:500]}); lost "
                f"with it: {lost}. Resume the job from its last checkpoint on the surviving "
                "nodes: the resumed driver's reissue() names the trajectories to re-write",
                node=relay.node,
                ranks=relay.ranks,
                units=units,
            )
            return self._failure

    def close(self) -> None:
        """Stop the pullers, close every relay (its rings go with it), end the actors."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        for source in self.write_back.values():
            source.close()
        closing: list[ray.ObjectRef] = [relay.actor.close.remote() for relay in self.live()]
        ray.wait(closing, num_returns=len(closing), timeout=30)
        for puller in self._pullers:
            puller.join(PULL_S + 10)
        self._kill()

    def _kill(self) -> None:
        for relay in self.relays:
            ray.kill(relay.actor)

    def _await_ready(
        self, timeout_s: float, homes: Mapping[str, Mapping[str, ActorHandle]]
    ) -> None:
        """Start every relay (``homes[node]``: where its groups are assembled, if elsewhere)."""
        calls: dict[ray.ObjectRef, _Relay] = {
            r.actor.start.remote(homes[r.node]): r for r in self.relays
        }
        done, late = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as error:
                raise NodeFailedError(
                    f"the control relay of {calls[ref].named()} did not start: {error}"
                ) from None
        if late:
            names = [calls[ref].named() for ref in late]
            raise NodeFailedError(
                f"the control relays of {names} did not start within {timeout_s} s "
                "(RayControl start_timeout_s): are those nodes alive and not full?"
            )

    def _pull(self, relay: _Relay) -> None:
        """Long-poll ``relay``'s write-back events into their groups' sources until closed."""
        while not self._stopping.is_set():
            call: ray.ObjectRef = relay.actor.pull.remote(PULL_S)
            try:
                events: list[_Event] = ray.get(call, timeout=PULL_S + self.call_timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as error:
                if not self._stopping.is_set():
                    self.lost(relay, error)
                return
            for event in events:
                self.write_back[event[1]].put(event, self._stopping)


def _groups(layout: ControlLayout) -> dict[str, tuple[int, int]]:
    """Each write-back group's (DP, CP) coordinates."""
    if layout.topology is None:
        raise ValueError("RayControl needs the job's topology in its ControlLayout")
    t = layout.topology
    return {group_name(d, c): (d, c) for d in range(t.dp) for c in range(t.cp)}


def _writers(control: RayControl, layout: ControlLayout) -> dict[str, int]:
    """Each group's writer rank: ``RayControl(writers=...)``, else Megatron's rank order."""
    groups = _groups(layout)
    assert layout.topology is not None
    writers = dict(control.writers or writer_ranks(layout.topology, layout.pipeline))
    wrong = sorted(set(writers) ^ set(groups))
    if wrong:
        raise ValueError(
            f"RayControl writers names groups {sorted(writers)}; the job's are {sorted(groups)}"
        )
    outside = {g: r for g, r in writers.items() if not 0 <= r < layout.world_size}
    if outside:
        raise ValueError(
            f"RayControl writers {outside} are outside the job's {layout.world_size} ranks"
        )
    return writers


class RayControl:
    """A ``knitkit.job.ControlPlane`` for ranks on any node of a Ray cluster:
    ``Driver.Config(...).build(control=RayControl(placement))``.

    ``placement[r]`` is the Ray node id rank ``r`` runs on. One ``ControlRelay`` actor per
    node (pinned there, ``num_cpus=0``) holds that node's schedule ring and reads the
    write-back rings of the writer ranks there; ranks use ``RankHandle(spec, coords)``
    unchanged. See NOTE [ Ray control relays ].
    """

    def __init__(
        self,
        placement: Sequence[str],
        *,
        in_flight: int = 4,
        start_timeout_s: float = 120.0,
        call_timeout_s: float = 60.0,
        writers: Mapping[str, int] | None = None,
    ) -> None:
        """``in_flight``: schedule calls outstanding per relay; ``start_timeout_s``: bound of
        the relays' start; ``call_timeout_s``: a relay silent this long past a pull is dead;
        ``writers``: each (DP, CP) group's writer rank (TP 0 of the last stage) by group name,
        where ranks are not numbered in Megatron's default order (TP fastest, then CP, DP,
        stage: ``knitkit.job.control.writer_ranks``)."""
        if in_flight < 1:
            raise ValueError(f"RayControl in_flight={in_flight} must be >= 1")
        self.writers = dict(writers) if writers is not None else None
        self.placement = tuple(placement)
        self.in_flight = in_flight
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s

    def open(self, layout: ControlLayout) -> RayChannels:
        return RayChannels(self, layout)
