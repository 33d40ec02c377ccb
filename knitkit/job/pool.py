"""The driver's reorganizers: one per consumer group, behind a small pool seam (processes here, Ray actors in integration)."""

from __future__ import annotations

from collections.abc import Mapping
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
        """Queue one pass's assignment on group ``name``'s reorganizer (served in order)."""
        ...

    def check(self) -> None:
        """Raise ``ReorganizerFailedError`` naming a member that failed or died."""
        ...

    def replace(self, name: str) -> RingSpec:
        """Retire group ``name``'s reorganizer and start a fresh one on a new ring; returns the
        new ring (its consumers must attach to it). For recovery: re-submit the group's
        unfinished assignments afterwards."""
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
    ) -> None:
        """``groups``: group name -> number of consumers of its ring (its ranks' TP x PP)."""
        self._backend = backend
        self._sizes = dict(groups)
        self._num_slots, self._slot_bytes, self._join_s = num_slots, slot_bytes, join_timeout_s
        self._members: dict[str, ReorganizerProcess] = {}
        self._retired: dict[str, float] = {}
        """Figures of replaced members, taken before they closed."""
        try:
            for name in self._sizes:
                self._members[name] = self._start(name)
        except BaseException:
            self.close()
            raise

    @property
    def rings(self) -> dict[str, RingSpec]:
        return {name: member.spec for name, member in self._members.items()}

    def submit(
        self, name: str, minibatch_id: str, assignment: ConsumerPlan | EncoderRankPlan
    ) -> None:
        self._member(name).submit(minibatch_id, assignment)

    def pids(self) -> dict[str, int | None]:
        """Every member's process id, by group (for monitoring)."""
        return {name: member.pid for name, member in self._members.items()}

    def check(self) -> None:
        for name, member in self._members.items():
            reason = member.failure()
            if reason is not None:
                raise ReorganizerFailedError(
                    f"the reorganizer of {name} (ring {member.spec.name!r}) stopped: {reason}"
                )

    def replace(self, name: str) -> RingSpec:
        old = self._member(name)
        self._members[name] = self._start(name)
        self._retired = sum_over([self._retired, old.metrics()])
        old.close()
        return self._members[name].spec

    def metrics(self) -> dict[str, float]:
        return sum_over([self._retired, *(m.metrics() for m in self._members.values())])

    def close(self) -> None:
        for member in self._members.values():
            member.close()

    def _start(self, name: str) -> ReorganizerProcess:
        spec = RingSpec.new(
            num_slots=self._num_slots,
            slot_bytes=self._slot_bytes,
            num_consumers=self._sizes[name],
        )
        return ReorganizerProcess(self._backend, spec, join_timeout_s=self._join_s)

    def _member(self, name: str) -> ReorganizerProcess:
        try:
            return self._members[name]
        except KeyError:
            raise KeyError(
                f"no reorganizer for consumer group {name!r}; groups: {sorted(self._members)}"
            ) from None
