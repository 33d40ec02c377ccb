"""Plan dispatch on a Ray cluster: one reorganizer actor per consumer group, on its consumers' node."""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import ray
from ray.actor import ActorHandle

from knitkit.job.pool import ReorganizerDied, numbering, successor_ring, tagged, untagged
from knitkit.job.spec import PREFETCH_DEPTH, data_rings, group_name
from knitkit.metrics import sum_over
from knitkit.storage import (
    ConsumerPlan,
    EncoderRankPlan,
    EncoderTopology,
    MiniBatchPlan,
    RingSpec,
    Topology,
    UnitBackend,
)
from knitkit.storage.delivery import unlink_ring

from .pinning import pinned_to
from .reorganizer import ReorganizerActor


@dataclass(frozen=True, kw_only=True, slots=True)
class RingConfig:
    """Size of every reorganizer's slot ring."""

    num_slots: int = PREFETCH_DEPTH + 2
    """Look-ahead: micro-batches a reorganizer may publish before its consumers release them;
    as ``Driver.Config.num_slots``, at least the ranks' prefetch depth + 2 for a job's pool
    (NOTE [ Data ring slots ] in knitkit/job/driver.py)."""
    slot_bytes: int = 64 << 20
    """Capacity of one slot: the largest packed micro-batch must fit."""


class RayDispatcher:
    """Runs the reorganizers of one consumer layout as Ray actors and feeds them mini-batch plans.

    One actor per backbone (DP, CP) group, named ``backbone/dp<d>/cp<c>`` and shared by its TP
    ranks, and one per encoder DP rank, named ``<encoder>/dp<r>``. ``placement`` maps these
    names to the Ray node id where that group's consumers run (default: this process's node);
    each actor is pinned there and publishes into node-local shared memory, so consumers attach
    with ``MicroBatchConsumer(dispatcher.rings[name], tp_rank)`` on that node. Every actor reads
    from ``backend``, which must pickle into a reader of the same units (``RayBackend`` does,
    on any node).

    It is also a ``knitkit.job.ReorganizerPool``: ``Driver.Config(...).build(pool=dispatcher)``
    serves a job's passes through these actors (``submit`` per group and pass, ``check`` raises
    a failed ``deliver``'s error, ``replace`` restarts a group's actor on a fresh ring). Build it
    with the job's layout: ``pipeline`` stages (each stage's TP ranks read the group's ring of
    that stage, ``backbone/dp<d>/cp<c>/pp<s>``; place each on its stage's node).
    """

    def __init__(
        self,
        backend: UnitBackend,
        topology: Topology,
        *,
        encoders: Sequence[EncoderTopology] = (),
        placement: Mapping[str, str] | None = None,
        ring: RingConfig | None = None,
        pipeline: int = 1,
        liveness_timeout_s: float | None = None,
    ) -> None:
        """``liveness_timeout_s``: the ranks' bound (the job's ``Driver.Config``), which paces
        the actors' idle heartbeats (NOTE [ Heartbeat period ]; ``None``: 4 beats a second)."""
        self._liveness_s = liveness_timeout_s
        self.topology = topology
        ring = self._ring = ring or RingConfig()
        groups = {  # a ring per (DP, CP, stage): NOTE [ One ring per pipeline stage ]
            ring: topology.tp
            for d in range(topology.dp)
            for c in range(topology.cp)
            for ring in data_rings(group_name(d, c), pipeline)
        }
        groups.update({f"{e.name}/dp{r}": e.tp for e in encoders for r in range(e.dp)})
        placement = dict(placement or {})
        unknown = sorted(set(placement) - set(groups))
        if unknown:
            raise KeyError(
                f"placement names unknown consumer groups {unknown}; known: {sorted(groups)}"
            )
        here = ray.get_runtime_context().get_node_id()
        self._backend, self._sizes = backend, groups
        self._placement = {name: placement.get(name, here) for name in groups}
        self.rings: dict[str, RingSpec] = {}
        self._actors: dict[str, ActorHandle] = {}
        self._pending: dict[str, list[_Pending]] = {name: [] for name in groups}
        """Per group, the ``deliver`` calls ``submit`` queued that ``check`` has not seen end
        well (a restart re-submits them: see NOTE [ Reorganizer restart ] in knitkit/job)."""
        self._numbers = {name: numbering() for name in groups}
        self._retired: dict[str, float] = {}
        """Figures of replaced actors, taken before they closed."""
        self._lost: set[str] = set()
        """Ray node ids the job lost (``node_lost``): nothing there is waited for."""
        self._addresses: dict[str, str] = {}
        """Ray node id -> node address, for the per-node and per-link figures."""
        for name in groups:
            self._start(
                name,
                RingSpec.new(
                    num_slots=ring.num_slots, slot_bytes=ring.slot_bytes, num_consumers=groups[name]
                ),
            )
        located = [a.where.remote() for a in self._actors.values()]
        niced = [a.niceness.remote() for a in self._actors.values()]  # asked in the same round
        self.nodes: dict[str, tuple[str, int]] = dict(zip(groups, ray.get(located), strict=True))
        """Consumer group name -> (node id, pid) of its reorganizer."""
        niceness: list[int] = ray.get(niced)
        _warn_if_behind(dict(zip(groups, niceness, strict=True)))

    def dispatch(self, plan: MiniBatchPlan) -> dict[str, ray.ObjectRef]:
        """Queue every group's assignment of ``plan``; returns, per group, a ref to its count.

        Returns at once: each reorganizer publishes micro-batch by micro-batch while consumers
        read, after the assignments queued before this one.
        """
        if plan.topology != self.topology:
            raise ValueError(
                f"plan {plan.minibatch_id!r} is for {plan.topology}; this dispatcher runs {self.topology}"
            )
        assignments: dict[str, ConsumerPlan | EncoderRankPlan] = {c.name: c for c in plan.consumers}
        assignments.update({r.name: r for e in plan.encoders for r in e.ranks})
        unknown = sorted(set(assignments) - set(self._actors))
        if unknown:
            raise KeyError(f"plan {plan.minibatch_id!r} has groups {unknown} with no reorganizer")
        return {
            name: self._actors[name].deliver.remote(plan.minibatch_id, assignment)
            for name, assignment in assignments.items()
        }

    def submit(
        self, name: str, minibatch_id: str, assignment: ConsumerPlan | EncoderRankPlan
    ) -> None:
        """Queue one assignment on group ``name``'s actor (``ReorganizerPool``); its outcome is
        seen by ``check``."""
        if name not in self._actors:
            raise KeyError(
                f"no reorganizer for consumer group {name!r}; groups: {sorted(self._actors)}"
            )
        self._deliver(name, tagged(minibatch_id, next(self._numbers[name])), assignment)

    def check(self) -> None:
        """Raise ``ReorganizerFailedError`` naming the group whose ``deliver`` failed (the
        actor's error), ``ReorganizerDied`` (a subclass) if its actor died; calls that ended
        well are forgotten (``ReorganizerPool``)."""
        from knitkit.job import ReorganizerFailedError

        for name, pending in self._pending.items():
            if not pending:
                continue
            done, _ = ray.wait([p.ref for p in pending], num_returns=len(pending), timeout=0)
            ended = set(done)
            while pending and pending[0].ref in ended:  # in order: a deliver follows the last
                try:
                    ray.get(pending[0].ref)
                except ray.exceptions.RayActorError as error:
                    unreachable = ""
                    if isinstance(error, ray.exceptions.ActorUnavailableError):
                        unreachable = self._placement[name]  # its node: gone or cut off
                        self._lost.add(unreachable)
                    raise ReorganizerDied(
                        name, self._stopped(name, error), unreachable_node=unreachable
                    ) from None
                except (ray.exceptions.RayError, RuntimeError) as error:
                    raise ReorganizerFailedError(self._stopped(name, error)) from None
                pending.pop(0)

    def replace(self, name: str) -> RingSpec:
        """Retire group ``name``'s actor and start a fresh one on its ``successor_ring``, on the
        same node, re-submitting every ``deliver`` not seen to end well (``ReorganizerPool``;
        its ranks move to the new ring by themselves: NOTE [ Reorganizer restart ] in
        knitkit/job). ``ReorganizerFailedError`` if the group's node is gone (its ranks are
        gone with it: ``node_lost``, a call failed unreachable, or Ray lists it dead) or the
        fresh actor does not start within ``_START_S``."""
        from knitkit.job import ReorganizerFailedError

        node = self._placement[name]
        if node in self._lost or node not in {n["NodeID"] for n in ray.nodes() if n["Alive"]}:
            raise ReorganizerFailedError(
                f"cannot restart the reorganizer of {name}: its node {node} is gone, and the "
                "group's ranks with it; resume the job from its last checkpoint",
                unreachable_node=node,
            )
        old, old_spec = self._actors[name], self.rings[name]
        self._retired = sum_over([self._retired, self._figures(old)])
        try:
            ray.get(old.close.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            ray.wait(
                [
                    _unlink_ring.options(scheduling_strategy=pinned_to(self.nodes[name][0])).remote(
                        old_spec.name
                    )
                ],
                timeout=30,
            )
        ray.kill(old)
        unfinished, self._pending[name] = _not_returned(self._pending[name]), []
        self._start(name, successor_ring(old_spec))
        try:
            where = cast(
                tuple[str, int], ray.get(self._actors[name].where.remote(), timeout=_START_S)
            )
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
            raise ReorganizerFailedError(
                f"the restarted reorganizer of {name} did not start on node {node}: {error}"
            ) from None
        self.nodes[name] = where
        for entry in unfinished:
            self._deliver(name, entry.tag, entry.assignment)
        return self.rings[name]

    def unpublished(self, name: str) -> frozenset[str]:
        """Ids of the mini-batches of group ``name``'s ``deliver`` calls ``check`` has not seen
        return (``ReorganizerPool``): the actor may still read their units."""
        return frozenset(untagged(p.tag) for p in self._pending.get(name, ()))

    def bytes_read(self) -> dict[str, int]:
        """Payload bytes each reorganizer read from storage so far."""
        return dict(
            zip(
                self._actors,
                ray.get([a.bytes_read.remote() for a in self._actors.values()]),
                strict=True,
            )
        )

    def metrics(self) -> dict[str, float]:
        """Figures of every reorganizer together, cumulative since they started:

        - ``knitkit/delivery/reorganizer_bytes_read``: payload bytes read from storage;
        - ``knitkit/delivery/reorganizer_fill_s``: thread CPU seconds spent writing them into
          slots (NOTE [ Fill time ] in knitkit/storage/delivery/reorganizer.py);
        - ``knitkit/delivery/reorganizer_published``: micro-batches published;

        and with a ``RayBackend`` (its ``traffic()``; see NOTE [ Ray unit directory ]), by node
        address (``198.18.0.2``):

        - ``knitkit/delivery/reorganizer_bytes_read_local`` / ``_remote``: of those bytes, read
          from units put on the reorganizer's own node / on another node;
        - ``knitkit/delivery/reorganizer_bytes_whole_remote``: bytes of the whole objects behind
          the remote reads (Ray moves whole objects; over ``_remote``: the whole-object cost),
          an upper bound of what crossed the links for them;
        - ``knitkit/delivery/reorganizer_bytes_read_by_node/<node>``: bytes read by the
          reorganizers on ``<node>``;
        - ``knitkit/delivery/reorganizer_bytes_whole_by_link/<from>_to_<to>``: the same, by the
          node ``<from>`` that put the units and the node ``<to>`` that read them.
        """
        return sum_over([self._retired, *(self._figures(a) for a in self._actors.values())])

    def finish(self) -> None:
        """No more plans: consumers stop (StopIteration) after the last queued micro-batch."""
        for actor in self._actors.values():
            actor.finish.remote()

    def node_lost(self, node: str) -> None:
        """Ray node ``node`` is gone (the driver's ``NodeFailedError``): ``close`` waits for
        none of its actors (``knitkit.job.control.NodeAware``)."""
        self._lost.add(node)

    def close(self) -> None:
        """Stop every reorganizer, unlink its ring and end its actor; idempotent; bounded by
        ``_CLOSE_S`` in all (the actors close at once, not one after another).

        A ring whose actor died (killed, crashed) is unlinked by a task on the actor's node. An
        actor on a lost node (``node_lost``, one of its calls failed unreachable, or Ray lists
        the node dead) is neither waited for nor its ring unlinked: the ring died with the node's /dev/shm
        (NOTE [ One error for a lost node ] in relay.py).
        """
        actors, self._actors = self._actors, {}
        died, lost = self._dead(actors)
        closing: dict[ray.ObjectRef, str] = {
            actor.close.remote(): name
            for name, actor in actors.items()
            if name not in died and name not in lost
        }
        done, late = ray.wait(list(closing), num_returns=len(closing), timeout=_CLOSE_S)
        orphans = set(died) | {closing[ref] for ref in late}
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                orphans.add(closing[ref])
        for actor in actors.values():
            ray.kill(actor)
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        unlinks = [
            _unlink_ring.options(scheduling_strategy=pinned_to(self.nodes[name][0])).remote(
                self.rings[name].name
            )
            for name in sorted(orphans - lost)
            if self.nodes[name][0] in alive
        ]
        ray.wait(unlinks, num_returns=len(unlinks), timeout=_CLOSE_S)

    def _dead(self, actors: Mapping[str, ActorHandle]) -> tuple[set[str], set[str]]:
        """Of ``actors``: those whose calls ended in the actor's death, and those on a lost
        node (``node_lost``, a call failed with the actor unreachable, or Ray lists its node
        dead); no wait."""
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        died: set[str] = set()
        lost = {name for name in actors if self.nodes[name][0] not in alive - self._lost}
        for name in actors:
            refs = [p.ref for p in self._pending.get(name, ())]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in done:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.ActorUnavailableError:
                    lost.add(name)
                except ray.exceptions.RayActorError:
                    died.add(name)
                except (ray.exceptions.RayError, RuntimeError):
                    continue
        return died - lost, lost

    def __enter__(self) -> RayDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, name: str, spec: RingSpec) -> None:
        """A fresh actor for group ``name`` on its node, publishing into ring ``spec``."""
        self.rings[name] = spec
        self._actors[name] = ReorganizerActor.options(  # type: ignore[attr-defined]
            scheduling_strategy=pinned_to(self._placement[name]),
            name=f"knitkit-reorganizer/{spec.name}",
        ).remote(self._backend, spec, self._liveness_s)

    def _deliver(self, name: str, tag: str, assignment: ConsumerPlan | EncoderRankPlan) -> None:
        ref: ray.ObjectRef = self._actors[name].deliver.remote(tag, assignment)
        self._pending[name].append(_Pending(ref, tag, assignment))

    def _figures(self, actor: ActorHandle) -> dict[str, float]:
        """One actor's figures (``metrics()`` names); none once it is dead (its figures are gone
        with it). Its figure methods run beside a blocked ``deliver`` (the control group)."""
        try:
            figures: list[Any] = ray.get(
                [
                    actor.bytes_read.remote(),
                    actor.fill_s.remote(),
                    actor.published.remote(),
                    actor.traffic.remote(),
                ],
                timeout=30,
            )
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return {}
        read, fill_s, published, traffic = figures
        return {
            "knitkit/delivery/reorganizer_bytes_read": float(read),
            "knitkit/delivery/reorganizer_fill_s": float(fill_s),
            "knitkit/delivery/reorganizer_published": float(published),
            **_traffic_figures(traffic, self._address),
        }

    def _address(self, node_id: str) -> str:
        """A Ray node's address, ``<address>:<id prefix>`` where nodes share one (several
        raylets on one machine), its id where Ray no longer lists it."""
        if node_id not in self._addresses:
            nodes = ray.nodes()
            shared = Counter(n["NodeManagerAddress"] for n in nodes)
            self._addresses.update(
                {
                    n["NodeID"]: n["NodeManagerAddress"]
                    + (f":{n['NodeID'][:8]}" if shared[n["NodeManagerAddress"]] > 1 else "")
                    for n in nodes
                }
            )
        return self._addresses.get(node_id, node_id)

    def _stopped(self, name: str, error: BaseException) -> str:
        return (
            f"the reorganizer actor of {name} (ring {self.rings[name].name!r}, node "
            f"{self.nodes[name][0]}) failed: {error}"
        )


_CLOSE_S = 30.0
"""Bound of ``close``'s wait for the actors' close calls, then for the orphan rings' unlinks."""
_START_S = 120.0
"""Bound of a restarted actor's start (its node may be gone: the job then fails, named)."""


def _traffic_figures(traffic: Mapping[str, Any], address: Callable[[str], str]) -> dict[str, float]:
    """``RayBackend.traffic()`` of one reorganizer as ``metrics()`` names (node ids -> addresses)."""
    if not traffic:
        return {}
    here = str(traffic["node"])
    read: Mapping[str, int] = traffic["read"]
    whole: Mapping[str, int] = traffic["whole"]
    prefix = "knitkit/delivery/reorganizer_bytes"
    out = {
        f"{prefix}_read_local": float(read.get(here, 0)),
        f"{prefix}_read_remote": float(sum(n for node, n in read.items() if node != here)),
        f"{prefix}_whole_remote": float(sum(whole.values())),
        f"{prefix}_read_by_node/{address(here)}": float(sum(read.values())),
    }
    for node, n in whole.items():
        out[f"{prefix}_whole_by_link/{address(node)}_to_{address(here)}"] = float(n)
    return out


@dataclass(frozen=True, slots=True)
class _Pending:
    """A ``deliver`` call: its result, and what to re-submit if its actor dies first."""

    ref: ray.ObjectRef
    tag: str
    assignment: ConsumerPlan | EncoderRankPlan


def _not_returned(pending: list[_Pending]) -> list[_Pending]:
    """The calls of a killed actor that did not return: one that returned before the death
    handed out every micro-batch (its mini-batch may be released since), so it is not re-served.
    Bounded: a killed actor's calls resolve at once, to their result or to its death."""
    ray.wait([p.ref for p in pending], num_returns=len(pending), timeout=_START_S)
    out = []
    for call in pending:
        try:
            ray.get(call.ref, timeout=0)
        except (ray.exceptions.RayError, RuntimeError):
            out.append(call)
    return out


def _warn_if_behind(niceness: Mapping[str, int]) -> None:
    """Warn once per dispatcher where its reorganizers run at a higher niceness than this
    process (Ray's default 15): beside the trainer's ranks they starve (NOTE [ Ray workers at
    the trainer's priority ] in runtime.py)."""
    mine = os.nice(0)
    behind = {name: n for name, n in niceness.items() if n > mine}
    if behind:
        warnings.warn(
            f"knitkit's reorganizer actors {sorted(behind)} run at niceness "
            f"{sorted(set(behind.values()))}, behind this process ({mine}): where they share "
            "cores with the trainer's ranks they get a small fraction of a core. Start Ray's "
            "workers with RAY_worker_niceness=0 in every node's environment (or "
            "knitkit.integration.ray.start_ray, which does)",
            RuntimeWarning,
            stacklevel=3,
        )


@ray.remote(num_cpus=0)
def _unlink_ring(name: str) -> bool:
    return unlink_ring(name)
