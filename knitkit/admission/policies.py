"""Named admission policies, all built on the same ``AdmissionController``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from knitkit.admission.config import AdmissionConfig, check_sources
from knitkit.admission.controller import AdmissionController
from knitkit.admission.predicates import SourceQuota
from knitkit.admission.schedules import (
    BarrierSchedule,
    FinalOnlySchedule,
    LinearSchedule,
    RelaxedSchedule,
)
from knitkit.admission.selection import OldestFirst, PacedSelection

PolicyOptions = dict[str, Any]

_POLICIES: dict[str, tuple[str, Callable[[], PolicyOptions]]] = {
    "barrier": (
        "train-batch admission: nothing is admitted until the whole train batch meets its quotas",
        lambda: {"source_schedule": BarrierSchedule(), "size_schedule": BarrierSchedule()},
    ),
    "streaming": (
        "admit on completion, oldest first, quotas ignored (StreamRL/AsyncFlow-like)",
        lambda: {"enforce_quotas": False},
    ),
    "linear": (
        "source targets grow linearly with admission progress (alpha_t = t/n), with guards",
        lambda: {"source_schedule": LinearSchedule()},
    ),
    "noguard": (
        "relaxed progressive targets without feasibility guards",
        lambda: {"source_schedule": RelaxedSchedule(), "guards": False},
    ),
    "knittrans": (
        "relaxed progressive targets (0, 0, 1/2, 1 at n=4) plus feasibility guards (paper 5.1)",
        lambda: {"source_schedule": RelaxedSchedule()},
    ),
    "adaptive": (
        "guard-only targets with paced selection: admit as soon as the guard allows, taking "
        "each source's pace share of its remaining deficit as soon as it is ready",
        lambda: {"source_schedule": FinalOnlySchedule(), "selection": PacedSelection()},
    ),
}

POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
"""Every policy name ``build_controller`` accepts, in the order reports list them."""


def describe(policy: str) -> str:
    return _POLICIES[_check(policy)][0]


def _check(policy: str) -> str:
    if policy not in _POLICIES:
        raise ValueError(
            f"unknown admission policy {policy!r}; choose from {', '.join(POLICY_NAMES)}"
        )
    return policy


def policy_config(
    policy: str,
    *,
    train_batch_size: int,
    num_minibatches: int,
    sources: Sequence[str],
    quotas: Sequence[SourceQuota] = (),
    **overrides: Any,
) -> AdmissionConfig:
    """The ``AdmissionConfig`` of a named policy; ``overrides`` set any other config field."""
    if isinstance(sources, str):
        check_sources(sources)  # refuses it by name: "ab" is not the sources ("a", "b")
    options: PolicyOptions = {"selection": OldestFirst(), **_POLICIES[_check(policy)][1]()}
    options.update(overrides)
    return AdmissionConfig(
        train_batch_size=train_batch_size,
        num_minibatches=num_minibatches,
        sources=tuple(sources),
        quotas=tuple(quotas),
        **options,
    )


def build_controller(
    policy: str,
    *,
    train_batch_size: int,
    num_minibatches: int,
    sources: Sequence[str],
    quotas: Sequence[SourceQuota] = (),
    **overrides: Any,
) -> AdmissionController:
    """An ``AdmissionController`` running the named policy (see ``POLICY_NAMES``)."""
    return AdmissionController(
        policy_config(
            policy,
            train_batch_size=train_batch_size,
            num_minibatches=num_minibatches,
            sources=sources,
            quotas=quotas,
            **overrides,
        )
    )
