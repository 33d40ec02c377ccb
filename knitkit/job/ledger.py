"""The driver's position as plain data: per admitted mini-batch, what is served, produced and consumed."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from knitkit.job.passes import Pass
from knitkit.job.spec import encoder_rank_name
from knitkit.storage import ConsumerPlan, MiniBatchPlan


@dataclass(slots=True)
class PassLedger:
    """One pass of one mini-batch: which groups it was served to, which finished it, what they
    wrote back."""

    submitted: set[str] = field(default_factory=set)
    """Backbone groups whose reorganizers got the pass's whole assignment (NOTE [ Next pass per
    group ] in serving.py)."""
    started: set[str] = field(default_factory=set)
    """Backbone groups whose reorganizers got at least the pass's first micro-batches (NOTE
    [ Serving as write-backs arrive ] in serving.py)."""
    done: set[str] = field(default_factory=set)
    """Backbone groups whose writer rank finished the pass (``backbone/dp<d>/cp<c>``)."""
    received: dict[str, dict[str, set[int]]] = field(default_factory=dict)
    """Written field -> group -> micro-batch indices whose outputs arrived (and were stored)."""
    figures: dict[str, dict[str, float]] = field(default_factory=dict)
    """Group -> the figures its writer rank reported with the pass's end."""

    @property
    def served_to_any(self) -> bool:
        """Whether the pass was served, in part at least, to some group (its records may come
        in); ``MiniBatchLedger.served(pass)`` says whether it was served to every group."""
        return bool(self.started)


@dataclass(slots=True)
class MiniBatchLedger:
    """One admitted mini-batch: its identity, its one plan, and every pass's ledger."""

    minibatch_id: str
    train_batch: int
    index: int
    trajectories: tuple[str, ...]
    sources: dict[str, int]
    """Admitted trajectories per source."""
    plan: MiniBatchPlan
    """The registered plan (every pass's fields); each pass is served ``plan.with_fields``."""
    passes: dict[str, PassLedger]
    produced: set[str] = field(default_factory=set)
    """Written fields verified complete in the store for every trajectory."""
    verified: dict[str, set[str]] = field(default_factory=dict)
    """Written field -> trajectories whose field is verified complete in the store."""
    consumers: dict[str, ConsumerPlan] = field(default_factory=dict, repr=False)
    """Backbone group -> its share of the plan (filled on first use: ``consumer``)."""
    holders: dict[str, list[tuple[str, int]]] = field(default_factory=dict, repr=False)
    """Trajectory -> (group, micro-batch index) of every micro-batch holding a piece of it
    (computed once: ``lacking_for``)."""
    admission_figures: dict[str, float] = field(default_factory=dict)
    """The admission controller's figures right after it admitted this mini-batch."""
    store_consumers: set[str] = field(default_factory=set)
    """Store consumers (backbone groups, encoder ranks) not yet reported ``consumed``."""
    admitted: tuple[str, ...] = ()
    """The trajectories in admission order (a resumed driver re-plans from them)."""

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.plan.consumers)

    def consumer(self, group: str) -> ConsumerPlan:
        """The plan's share of backbone group ``group`` (the scheduler asks for it per group and
        micro-batch each time a write-back arrives: a lookup, not a scan of every group)."""
        if not self.consumers:
            self.consumers.update((c.name, c) for c in self.plan.consumers)
        return self.consumers[group]

    def needed(self, group: str) -> set[int]:
        """Indices of the group's micro-batches that hold real tokens (the ones written back)."""
        return {mb.index for mb in self.consumer(group).micro_batches if mb.sequences}

    def lacking(self, field_name: str, writer: Pass) -> dict[str, list[int]]:
        """Group -> its micro-batches whose ``field_name`` (written by ``writer``) is missing."""
        received = self.passes[writer.name].received[field_name]
        out = {g: sorted(self.needed(g) - received.get(g, set())) for g in self.groups}
        return {g: indices for g, indices in out.items() if indices}

    def consumed(self, pass_name: str) -> bool:
        return len(self.passes[pass_name].done) == len(self.groups)

    def served(self, pass_name: str) -> bool:
        """Whether the pass was served to every group."""
        return len(self.passes[pass_name].submitted) == len(self.groups)

    def trajectories_of(self, group: str) -> tuple[str, ...]:
        """The trajectories ``group`` reads (with CP, shared with its DP rank's other groups)."""
        ids = (s.trajectory_id for mb in self.consumer(group).micro_batches for s in mb.sequences)
        return tuple(dict.fromkeys(ids))

    def lacking_for(
        self,
        group: str,
        field_name: str,
        writer: Pass,
        micro_batches: slice = slice(None),
    ) -> dict[str, list[int]]:
        """Writer group -> its micro-batches holding pieces of the trajectories ``group`` reads
        (in its ``micro_batches``, default all) whose ``field_name`` (written by ``writer``) is
        missing: per trajectory, not per group (with CP a trajectory's pieces come from every
        CP group of its DP rank)."""
        if not self.holders:
            for consumer in self.plan.consumers:
                for mb in consumer.micro_batches:
                    for s in mb.sequences:
                        self.holders.setdefault(s.trajectory_id, []).append(
                            (consumer.name, mb.index)
                        )
        received = self.passes[writer.name].received[field_name]
        out: dict[str, set[int]] = {}
        for mb in self.consumer(group).micro_batches[micro_batches]:
            for s in mb.sequences:
                for holder, index in self.holders[s.trajectory_id]:
                    if index not in received.get(holder, ()):
                        out.setdefault(holder, set()).add(index)
        return {g: sorted(indices) for g, indices in out.items()}


@dataclass(slots=True)
class JobLedger:
    """The job's position (guarded by the driver's lock): every unreleased mini-batch's ledger in
    admission order, the serving order, and the counters; the driver's other parts hold only
    their own progress (see ``Driver`` for what each part holds)."""

    minibatches: dict[str, MiniBatchLedger] = field(default_factory=dict)
    """Admitted, unreleased mini-batches, in admission order."""
    order: list[str] = field(default_factory=list)
    """Every admitted mini-batch id, released ones included: the serving order."""
    released: int = 0
    observed: int = 0
    """Released mini-batches whose figures the observer got."""
    to_observe: deque[dict[str, float]] = field(default_factory=deque)
    """Figures of released mini-batches waiting for the observer (pushed by the scheduler)."""
    counts: Counter[str] = field(default_factory=Counter)
    """``passes_served``, ``passes_consumed``, ``write_back_records``, ``write_back_wakes``,
    ``write_back_bytes``."""
    wait_s: float = 0.0
    """Seconds the scheduler waited for passes' reads to be produced."""
    waiting: set[str] = field(default_factory=set)
    """Stored trajectories in no admitted mini-batch (pending in admission, or past the end)."""

    def position(self, minibatch_id: str) -> int:
        try:
            return self.order.index(minibatch_id)
        except ValueError:
            raise KeyError(
                f"mini-batch {minibatch_id!r} was never admitted; admitted: {self.order[-5:]}"
            ) from None


@dataclass(slots=True)
class Progress:
    """The driver's progress, readable at any time (``Driver.progress()``)."""

    admitted: int
    """Mini-batches admitted (and planned: one plan each, at admission)."""
    released: int
    """Mini-batches every pass consumed; their units are freed."""
    served: dict[str, int]
    """Per pass: mini-batches whose pass was served to every group (its reorganizers fed)."""
    consumed: dict[str, int]
    """Per pass: mini-batches every (DP, CP) group finished."""
    trajectories_waiting: int
    """Stored trajectories not in any admitted mini-batch (pending, filtered or past the end)."""
    blocked: str = ""
    """What the scheduler waits for, e.g. ``tb0-mb1/train waits for old_logprobs from
    ['backbone/dp0/cp0']``; empty when it is not waiting for write-backs."""


def new_ledger(
    minibatch_id: str,
    train_batch: int,
    index: int,
    sources: dict[str, int],
    plan: MiniBatchPlan,
    passes: tuple[Pass, ...],
    admission_figures: dict[str, float],
    admitted: tuple[str, ...],
) -> MiniBatchLedger:
    """The ledger of a freshly registered mini-batch (``admitted``: its ids in admission order)."""
    ledgers = {p.name: PassLedger(received={o.name: {} for o in p.writes}) for p in passes}
    trajectories = tuple(
        dict.fromkeys(
            s.trajectory_id for c in plan.consumers for mb in c.micro_batches for s in mb.sequences
        )
    )
    consumers = {c.name for c in plan.consumers}
    consumers |= {
        encoder_rank_name(e.topology.name, r.dp_rank) for e in plan.encoders for r in e.ranks
    }
    return MiniBatchLedger(
        minibatch_id,
        train_batch,
        index,
        trajectories,
        sources,
        plan,
        ledgers,
        admission_figures=admission_figures,
        store_consumers=consumers,
        admitted=admitted,
    )
