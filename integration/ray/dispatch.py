"""Plan dispatch on a Ray cluster: one reorganizer actor per consumer group, on its consumers' node."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

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

from .reorganizer import ReorganizerActor


@dataclass(frozen=True, kw_only=True, slots=True)
class RingConfig:
    """Size of every reorganizer's slot ring."""

    num_slots: int = 2
    """Look-ahead: micro-batches a reorganizer may publish before its consumers release them."""
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
    """

    def __init__(
        self,
        backend: UnitBackend,
        topology: Topology,
        *,
        encoders: Sequence[EncoderTopology] = (),
        placement: Mapping[str, str] | None = None,
        ring: RingConfig | None = None,
    ) -> None:
        self.topology = topology
        ring = ring or RingConfig()
        groups = {
            f"backbone/dp{d}/cp{c}": topology.tp
            for d in range(topology.dp)
            for c in range(topology.cp)
        }
        groups.update({f"{e.name}/dp{r}": e.tp for e in encoders for r in range(e.dp)})
        placement = dict(placement or {})
        unknown = sorted(set(placement) - set(groups))
        if unknown:
            raise KeyError(
                f"placement names unknown consumer groups {unknown}; known: {sorted(groups)}"
            )
        here = ray.get_runtime_context().get_node_id()
        self.rings: dict[str, RingSpec] = {}
        self._actors: dict[str, ActorHandle] = {}
        for name, num_consumers in groups.items():
            spec = RingSpec.new(
                num_slots=ring.num_slots, slot_bytes=ring.slot_bytes, num_consumers=num_consumers
            )
            self.rings[name] = spec
            self._actors[name] = ReorganizerActor.options(  # type: ignore[attr-defined]
                scheduling_strategy=_on(placement.get(name, here)),
                name=f"knitkit-reorganizer/{spec.name}",
            ).remote(backend, spec)
        self.nodes: dict[str, tuple[str, int]] = dict(
            zip(groups, ray.get([a.where.remote() for a in self._actors.values()]), strict=True)
        )
        """Consumer group name -> (node id, pid) of its reorganizer."""

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
        - ``knitkit/delivery/reorganizer_published``: micro-batches published.
        """
        actors = list(self._actors.values())
        read: list[int] = ray.get([a.bytes_read.remote() for a in actors])
        published: list[int] = ray.get([a.published.remote() for a in actors])
        return {
            "knitkit/delivery/reorganizer_bytes_read": float(sum(read)),
            "knitkit/delivery/reorganizer_published": float(sum(published)),
        }

    def finish(self) -> None:
        """No more plans: consumers stop (StopIteration) after the last queued micro-batch."""
        for actor in self._actors.values():
            actor.finish.remote()

    def close(self) -> None:
        """Stop every reorganizer, unlink its ring and end its actor; idempotent.

        A ring whose actor died (killed, crashed) is unlinked by a task on the actor's node.
        """
        actors, self._actors = self._actors, {}
        closing: dict[str, ray.ObjectRef] = {
            name: actor.close.remote() for name, actor in actors.items()
        }
        orphans: list[str] = []
        for name, pending in closing.items():
            try:
                ray.get(pending, timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                orphans.append(name)
            ray.kill(actors[name])
        unlinks = [
            _unlink_ring.options(scheduling_strategy=_on(self.nodes[name][0])).remote(
                self.rings[name].name
            )
            for name in orphans
        ]
        ray.wait(unlinks, num_returns=len(unlinks), timeout=30)

    def __enter__(self) -> RayDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@ray.remote(num_cpus=0)
def _unlink_ring(name: str) -> bool:
    return unlink_ring(name)


def _on(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)
