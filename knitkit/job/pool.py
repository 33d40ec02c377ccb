"""The driver's reorganizers: one per consumer group, behind a small pool seam (processes here, Ray actors in integration)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from typing import Protocol

from knitkit.job.errors import ReorganizerFailedError
from knitkit.metrics import sum_over
from knitkit.storage import (
    ConsumerPlan,
    EncoderRankPlan,
    ReorganizerProcess,
    RingSpec,
    UnitBackend,
)

Assignment = ConsumerPlan | EncoderRankPlan


class ReorganizerDied(ReorganizerFailedError):
    """A pool member is gone without an error of its own (its process was killed, its actor or
    node died): a fresh one can take over its group (see NOTE [ Reorganizer restart ] in
    recovery.py). ``group`` names the consumer group."""

    def __init__(self, group: str, message: str, *, unreachable_node: str = "") -> None:
        super().__init__(message, unreachable_node=unreachable_node)
        self.group = group


def successor_ring(spec: RingSpec) -> RingSpec:
    """The ring a group's restarted reorganizer publishes into: the same sizes under the next
    generation's name (``<name>_r<k>``), so the group's ranks find it without being told (see
    NOTE [ Reorganizer restart ] in recovery.py)."""
    base, marker, generation = spec.name.rpartition("_r")
    if marker and generation.isdigit():
        return dataclasses.replace(spec, name=f"{base}_r{int(generation) + 1}")
    return dataclasses.replace(spec, name=f"{spec.name}_r1")


def tagged(minibatch_id: str, number: int) -> str:
    """The id a pool hands its reorganizer with a group's ``number``-th assignment; it travels
    in every micro-batch's layout (``extra["minibatch_id"]``), so a rank can tell a re-served
    micro-batch it already took (see NOTE [ Reorganizer restart ] in recovery.py)."""
    return f"{minibatch_id}@{number}"


def untagged(tag: str) -> str:
    """The mini-batch id inside a ``tagged`` id."""
    return tag.rpartition("@")[0]


def pass_id(minibatch_id: str, pass_name: str) -> str:
    """The id the scheduler submits one pass's assignment under (``submit``): it travels in every
    micro-batch's layout, so a rank checks each one belongs to the (mini-batch, pass) it runs
    (NOTE [ Next pass per group ] in serving.py)."""
    return f"{minibatch_id}/{pass_name}"


def minibatch_of(submitted_id: str) -> str:
    """The mini-batch id inside a ``pass_id`` (mini-batch ids hold no ``/``)."""
    return submitted_id.partition("/")[0]


def numbering() -> Iterator[int]:
    """A group's assignment numbers (``tagged``): they keep counting across restarts."""
    return itertools.count()


class ReorganizerPool(Protocol):
    """The reorganizers serving one job, one per consumer group (``backbone/dp<d>/cp<c>``,
    ``<encoder>/dp<r>``), each publishing into its ring where the group's ranks run.

    The driver only calls these; ``ProcessPool`` (spawned processes on this node) and
    ``knitkit.integration.ray.RayDispatcher`` (Ray actors pinned to the consumers' nodes)
    implement it.
    """

    @property
    def rings(self) -> Mapping[str, RingSpec]:
        """Every group's ring, by group name."""
        ...

    def submit(
        self, name: str, minibatch_id: str, assignment: ConsumerPlan | EncoderRankPlan
    ) -> None:
        """Queue one pass's assignment on group ``name``'s reorganizer (served in order); the
        driver gives ``pass_id(mini-batch, pass)`` as ``minibatch_id``: an opaque id here."""
        ...

    def check(self) -> None:
        """Raise ``ReorganizerFailedError`` naming a member that failed, ``ReorganizerDied`` (a
        subclass) naming one that died (restartable: ``replace``)."""
        ...

    def replace(self, name: str) -> RingSpec:
        """Retire group ``name``'s reorganizer and start a fresh one on its ``successor_ring``,
        re-submitting (same ``tagged`` ids) every assignment the old one may not have handed to
        all its consumers; returns the new ring. See NOTE [ Reorganizer restart ] in
        recovery.py."""
        ...

    def unpublished(self, name: str) -> frozenset[str]:
        """Ids (as submitted) of the assignments group ``name``'s reorganizer has not
        published in full: it may still read their units, so the driver keeps them (see
        NOTE [ Reorganizer restart ] in recovery.py). Empty for a name that is no group."""
        ...

    def metrics(self) -> dict[str, float]:
        """Figures summed over members (``knitkit/delivery/reorganizer_*``, cumulative)."""
        ...

    def close(self) -> None:
        """Stop every member and unlink every ring; idempotent."""
        ...


class ProcessPool:
    """One ``ReorganizerProcess`` per consumer group, on this node (the driver's)."""

    def __init__(
        self,
        backend: UnitBackend,
        groups: Mapping[str, int],
        *,
        num_slots: int = 2,
        slot_bytes: int = 64 << 20,
        join_timeout_s: float = 5.0,
        liveness_timeout_s: float | None = None,
    ) -> None:
        """``groups``: group name -> number of consumers of its ring (the TP ranks of its (DP,
        CP, stage), NOTE [ One ring per pipeline stage ] in knitkit/storage/planning/plan.py);
        ``liveness_timeout_s``: the ranks' bound, which paces the reorganizers' waits (NOTE
        [ Heartbeat period ] in knitkit/storage/delivery/publication.py)."""
        self._backend = backend
        self._sizes = dict(groups)
        self._join_s = join_timeout_s
        self._liveness_s = liveness_timeout_s
        self._members: dict[str, ReorganizerProcess] = {}
        self._retired: dict[str, float] = {}
        """Figures of replaced members, taken before they closed."""
        self._numbers = {name: numbering() for name in self._sizes}
        self._queued: dict[str, list[tuple[str, Assignment, int]]] = {n: [] for n in self._sizes}
        """Per group, (tagged id, assignment, end) of what its member may not have published in
        full; ``end``: micro-batches on the member's ring once the assignment is published."""
        try:
            for name in self._sizes:
                self._members[name] = self._start(
                    RingSpec.new(
                        num_slots=num_slots, slot_bytes=slot_bytes, num_consumers=self._sizes[name]
                    )
                )
        except BaseException:
            self.close()
            raise

    @property
    def rings(self) -> dict[str, RingSpec]:
        return {name: member.spec for name, member in self._members.items()}

    def submit(
        self, name: str, minibatch_id: str, assignment: ConsumerPlan | EncoderRankPlan
    ) -> None:
        member = self._member(name)
        done = member.published()
        queued = self._queued[name] = [q for q in self._queued[name] if q[2] > done]
        self._put(name, tagged(minibatch_id, next(self._numbers[name])), assignment, queued)

    def pids(self) -> dict[str, int | None]:
        """Every member's process id, by group (for monitoring)."""
        return {name: member.pid for name, member in self._members.items()}

    def check(self) -> None:
        for name, member in self._members.items():
            reason = member.failure()
            if reason is not None:
                message = f"the reorganizer of {name} (ring {member.spec.name!r}) stopped: {reason}"
                if member.died():
                    raise ReorganizerDied(name, message)
                raise ReorganizerFailedError(message)

    def replace(self, name: str) -> RingSpec:
        old = self._member(name)
        done = old.published()  # its ring stays mapped here: ranks read what it published
        unfinished = [q for q in self._queued[name] if q[2] > done]
        self._members[name] = self._start(successor_ring(old.spec))
        self._retired = sum_over([self._retired, old.metrics()])
        old.close()
        queued = self._queued[name] = []
        for tag, assignment, _ in unfinished:
            self._put(name, tag, assignment, queued)
        return self._members[name].spec

    def unpublished(self, name: str) -> frozenset[str]:
        member = self._members.get(name)
        if member is None:
            return frozenset()
        published = member.published()
        return frozenset(untagged(tag) for tag, _, end in self._queued[name] if end > published)

    def metrics(self) -> dict[str, float]:
        return sum_over([self._retired, *(m.metrics() for m in self._members.values())])

    def close(self) -> None:
        for member in self._members.values():
            member.close()

    def _start(self, spec: RingSpec) -> ReorganizerProcess:
        return ReorganizerProcess(
            self._backend, spec, join_timeout_s=self._join_s, liveness_timeout_s=self._liveness_s
        )

    def _put(
        self,
        name: str,
        tag: str,
        assignment: Assignment,
        queued: list[tuple[str, Assignment, int]],
    ) -> None:
        """Submit under ``tag`` and remember it until its member published all of it."""
        end = (queued[-1][2] if queued else self._members[name].published()) + len(
            assignment.micro_batches
        )
        self._members[name].submit(tag, assignment)
        queued.append((tag, assignment, end))

    def _member(self, name: str) -> ReorganizerProcess:
        try:
            return self._members[name]
        except KeyError:
            raise KeyError(
                f"no reorganizer for consumer group {name!r}; groups: {sorted(self._members)}"
            ) from None
