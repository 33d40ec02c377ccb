"""Admission configuration and its construction-time checks (bad configs fail here, clearly)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from knitkit.admission import checks
from knitkit.admission.bounds import GroupBounds
from knitkit.admission.predicates import ReadinessPredicate, SourceQuota
from knitkit.admission.schedules import LinearSchedule, RelaxedSchedule, Schedule, coefficients
from knitkit.admission.selection import OldestFirst, SelectionPolicy


@dataclass(kw_only=True, slots=True)
class AdmissionConfig:
    """Everything an ``AdmissionController`` needs; ``resolve()`` validates it."""

    train_batch_size: int
    """tau_0: trajectories per train batch (the batch whose training triggers a parameter sync)."""
    num_minibatches: int
    """n: optimizer steps (mini-batches) per train batch."""
    sources: tuple[str, ...]
    """Every data source a trajectory may come from; reports from other sources are rejected."""
    quotas: tuple[SourceQuota, ...] = ()
    source_schedule: Schedule = field(default_factory=RelaxedSchedule)
    """Progressive-target schedule of source quotas without their own ``schedule``."""
    size_schedule: Schedule = field(default_factory=LinearSchedule)
    """Schedule of the train-batch size target tau_0."""
    enforce_quotas: bool = True
    """False: quotas are only measured (streaming admission); no readiness targets, no guards."""
    guards: bool = True
    """Check the feasibility guard (paper eq. 4, one over every source quota) on each candidate."""
    selection: SelectionPolicy = field(default_factory=OldestFirst)
    predicates: tuple[ReadinessPredicate, ...] = ()
    """Readiness-only predicates (partial-rollout completion quotas, user conditions)."""
    max_staleness: int | None = None
    """Drop (and count) trajectories older than this many versions at the training version."""
    group_size: int = 1
    """> 1 admits whole GRPO groups (all trajectories of a ``sample_id``) atomically."""
    rollout_budget: Mapping[str, int] | None = None
    """Most trajectories of a source outstanding at once (in flight + ready); checks reachability."""
    initial_version: int = 0
    """Training version of train batch 0; train batch k trains at ``initial_version + k``."""


@dataclass(frozen=True, slots=True)
class ResolvedQuota:
    """A source quota with its bounds in trajectories and its validated coefficients."""

    source: str
    lower: int
    upper: int | None
    alphas: tuple[float, ...]
    groups: GroupBounds
    """The bounds in whole GRPO groups, what every decision compares with (NOTE [ Bounds in
    whole groups ])."""


def minibatch_sizes(config: AdmissionConfig) -> tuple[int, ...]:
    """Split the train batch into ``n`` mini-batches (whole GRPO groups), larger ones first."""
    units = config.train_batch_size // config.group_size
    base, extra = divmod(units, config.num_minibatches)
    return tuple(
        (base + (1 if t < extra else 0)) * config.group_size for t in range(config.num_minibatches)
    )


def check_sources(sources: object) -> None:
    """Sources must be a sequence of distinct non-empty names; a bare string is refused."""
    if isinstance(sources, str) or not isinstance(sources, tuple | list) or not sources:
        raise ValueError(
            f"sources={sources!r}: give a list of source names, at least one (a string is "
            f"refused: 'ab' would silently mean two sources 'a' and 'b')"
        )
    for source in sources:
        checks.name(source, "source")
    if len(set(sources)) != len(sources):
        raise ValueError(f"sources={tuple(sources)!r}: give each source once")


def resolve(config: AdmissionConfig) -> tuple[tuple[ResolvedQuota, ...], tuple[int, ...]]:
    """Validate ``config``; return its resolved quotas and mini-batch sizes, or raise ValueError."""
    b = checks.whole(config.train_batch_size, "train_batch_size", minimum=1)
    n = checks.whole(config.num_minibatches, "num_minibatches", minimum=1)
    g = checks.whole(config.group_size, "group_size", minimum=1)
    checks.whole(config.initial_version, "initial_version", minimum=None)
    if b % g or b // g < n:
        raise ValueError(
            f"train_batch_size={b} must be a multiple of group_size={g} with at least one "
            f"group per mini-batch (num_minibatches={n})"
        )
    check_sources(config.sources)
    if config.max_staleness is not None:
        checks.whole(config.max_staleness, "max_staleness")
    checks.implements(config.selection, SelectionPolicy, "selection")
    for name in ("source_schedule", "size_schedule"):
        checks.implements(getattr(config, name), Schedule, name)
    size_alphas = coefficients(config.size_schedule, n, name="size_schedule")
    if not isinstance(config.predicates, tuple | list):
        raise ValueError(f"predicates={config.predicates!r}: give a tuple of readiness predicates")
    for k, predicate in enumerate(config.predicates):
        checks.implements(predicate, ReadinessPredicate, f"predicates[{k}]")
        checks.implements(predicate.schedule, Schedule, f"predicates[{k}].schedule")
        coefficients(predicate.schedule, n, name=f"predicate {predicate.name!r}")
    quotas: list[ResolvedQuota] = []
    for quota in config.quotas:
        if quota.source not in config.sources:
            raise ValueError(
                f"quota names unknown source {quota.source!r}; sources: {config.sources}"
            )
        if any(q.source == quota.source for q in quotas):
            raise ValueError(f"two quotas for source {quota.source!r}; merge them into one")
        lower, upper = quota.bounds(b)
        schedule = quota.schedule or config.source_schedule
        checks.implements(schedule, Schedule, f"quota {quota.source!r}: schedule")
        alphas = coefficients(schedule, n, name=f"schedule of quota {quota.source!r}")
        groups = GroupBounds.of(lower, upper, g)
        quotas.append(ResolvedQuota(quota.source, lower, upper, alphas, groups))
    _check_satisfiable(config, quotas)
    _check_budget(config, quotas, size_alphas)
    return tuple(quotas), minibatch_sizes(config)


def _check_satisfiable(config: AdmissionConfig, quotas: list[ResolvedQuota]) -> None:
    b, g = config.train_batch_size, config.group_size
    need = {q.source: q.groups.lower for q in quotas}
    if sum(need.values()) > b:
        detail = ", ".join(f"{s}>={v}" for s, v in need.items())
        raise ValueError(
            f"quotas are jointly unsatisfiable: lower bounds {detail} sum to {sum(need.values())} "
            f"> train_batch_size={b}; lower a bound or grow the train batch"
        )
    uppers = {q.source: q.groups.upper for q in quotas if q.groups.upper is not None}
    for source, upper in uppers.items():
        if upper < need[source]:
            raise ValueError(
                f"quota {source!r} cannot be met in whole GRPO groups of {g}: it needs at least "
                f"{need[source]} but at most {upper} trajectories; widen its bounds"
            )
    if len(uppers) == len(config.sources) and sum(uppers.values()) < b:
        raise ValueError(
            f"quotas are jointly unsatisfiable: every source is upper-bounded and the bounds "
            f"{uppers} sum to less than train_batch_size={b}"
        )


def _check_budget(
    config: AdmissionConfig, quotas: list[ResolvedQuota], size_alphas: tuple[float, ...]
) -> None:
    budget = config.rollout_budget
    if budget is None:
        return
    for source, value in budget.items():
        if source not in config.sources:
            raise ValueError(f"rollout_budget names unknown source {source!r}")
        checks.whole(value, f"rollout_budget[{source!r}]")
    if not config.enforce_quotas:
        return
    for quota in quotas:
        first = math.ceil(quota.alphas[0] * quota.lower - 1e-9)
        have = budget.get(quota.source)
        if have is not None and (have < first or (quota.lower > 0 and have == 0)):
            raise ValueError(
                f"quota {quota.source!r} can never be met: its first readiness target needs {first} "
                f"trajectories but rollout_budget allows {have} outstanding; raise the budget "
                f"or relax the schedule"
            )
    if len(budget) == len(config.sources):
        first_size = max(math.ceil(size_alphas[0] * config.train_batch_size - 1e-9), 1)
        if sum(budget.values()) < first_size:
            raise ValueError(
                f"the first size target needs {first_size} ready trajectories but the rollout "
                f"budget allows {sum(budget.values())} outstanding in total"
            )
