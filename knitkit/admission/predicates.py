"""Train-batch predicates: per-source quotas (guarded) and readiness-only predicates (completion, user)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from knitkit.admission import checks
from knitkit.admission.schedules import LinearSchedule, Schedule


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceQuota:
    """Bounds on how many trajectories of one source a train batch holds (paper: P_i, s_i >= tau_i).

    Give the lower bound as a count or as a ratio of the train batch (``tau_i = r_i * tau_0``,
    rounded up); the optional upper bound likewise (rounded down). Every trajectory has one
    source, so all source quotas compete for the same batch slots and share one feasibility
    guard, whatever their ``group`` (see NOTE [ One guard over every source quota ]).
    """

    source: str
    min_count: int | None = None
    min_ratio: float | None = None
    max_count: int | None = None
    max_ratio: float | None = None
    group: str = "sources"
    """A label (quota files and replay settings keep it); it does not split the guard."""
    schedule: Schedule | None = None
    """Progressive-target schedule for this quota; ``None`` uses the policy's source schedule."""

    def __post_init__(self) -> None:
        checks.name(self.source, "quota source")
        checks.name(self.group, f"quota {self.source!r}: group")
        for field_name in ("min_count", "max_count"):
            value = getattr(self, field_name)
            if value is not None:
                checks.whole(value, f"quota {self.source!r}: {field_name}")
        for field_name in ("min_ratio", "max_ratio"):
            value = getattr(self, field_name)
            if value is not None:
                checks.ratio(value, f"quota {self.source!r}: {field_name}")
        if self.min_count is not None and self.min_ratio is not None:
            raise ValueError(f"quota {self.source!r}: give min_count or min_ratio, not both")
        if self.max_count is not None and self.max_ratio is not None:
            raise ValueError(f"quota {self.source!r}: give max_count or max_ratio, not both")

    def bounds(self, train_batch_size: int) -> tuple[int, int | None]:
        """``(lower, upper)`` in trajectories for a train batch of ``train_batch_size``."""
        lower = int(self.min_count or 0)
        if self.min_ratio is not None:
            lower = math.ceil(self.min_ratio * train_batch_size - 1e-9)
        upper = None if self.max_count is None else int(self.max_count)
        if self.max_ratio is not None:
            upper = math.floor(self.max_ratio * train_batch_size + 1e-9)
        if upper is not None and upper < lower:
            raise ValueError(
                f"quota {self.source!r}: upper bound {upper} < lower bound {lower} "
                f"at train batch size {train_batch_size}"
            )
        return lower, upper


@dataclass(frozen=True, slots=True)
class AdmissionView:
    """Read-only counts a readiness predicate may look at when mini-batch ``minibatch`` is proposed."""

    train_batch: int
    minibatch: int
    """1-based index of the candidate mini-batch within the train batch."""
    ready: Mapping[str, int]
    """Accepted, not yet admitted trajectories per source."""
    admitted: Mapping[str, int]
    """Trajectories per source already admitted into this train batch."""
    completed_by_step: Mapping[int, int] = field(default_factory=dict)
    """Reported (completed) trajectories per rollout step, accepted or not."""
    issued_by_step: Mapping[int, int] = field(default_factory=dict)
    """Trajectories issued per rollout step, as told by ``AdmissionController.issued``."""


@runtime_checkable
class ReadinessPredicate(Protocol):
    """A readiness condition P_i: ``progress(view) >= target(view)``, reached progressively.

    The controller snapshots ``progress`` when a train batch opens (``s_{i,0}``) and requires
    ``progress >= s_{i,0} + alpha_{i,t} (target - s_{i,0})`` before proposing mini-batch t.
    Readiness predicates gate proposals; unlike source quotas they are never capacity guards.
    """

    @property
    def name(self) -> str: ...

    @property
    def schedule(self) -> Schedule: ...

    def progress(self, view: AdmissionView) -> float: ...

    def target(self, view: AdmissionView) -> float: ...


@dataclass(frozen=True, slots=True)
class CompletionQuota:
    """Partial-rollout completion quota: a share of the newest rollout step's trajectories has completed."""

    min_ratio: float
    schedule: Schedule = field(default_factory=LinearSchedule)
    name: str = "completion"

    def __post_init__(self) -> None:
        checks.ratio(self.min_ratio, "CompletionQuota.min_ratio")

    def progress(self, view: AdmissionView) -> float:
        step = max(view.issued_by_step, default=None)
        return 0.0 if step is None else float(view.completed_by_step.get(step, 0))

    def target(self, view: AdmissionView) -> float:
        step = max(view.issued_by_step, default=None)
        return 0.0 if step is None else self.min_ratio * view.issued_by_step[step]
