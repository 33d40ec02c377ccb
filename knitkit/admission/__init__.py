"""Constraint-preserving mini-batch admission (paper 5.1); the trace-replay simulator is ``knitkit.admission.replay``."""

from knitkit.admission.config import AdmissionConfig
from knitkit.admission.controller import AdmissionController, AdmissionStats, MiniBatch, Shortfall
from knitkit.admission.policies import POLICY_NAMES, build_controller, describe, policy_config
from knitkit.admission.predicates import (
    AdmissionView,
    CompletionQuota,
    ReadinessPredicate,
    SourceQuota,
)
from knitkit.admission.schedules import (
    BarrierSchedule,
    ExplicitSchedule,
    FinalOnlySchedule,
    LinearSchedule,
    RelaxedSchedule,
    Schedule,
)
from knitkit.admission.selection import (
    CandidateRequest,
    OldestFirst,
    PacedSelection,
    SelectionPolicy,
)
from knitkit.admission.state import AdmissionSnapshot

__all__ = [
    "POLICY_NAMES",
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionSnapshot",
    "AdmissionStats",
    "AdmissionView",
    "BarrierSchedule",
    "CandidateRequest",
    "CompletionQuota",
    "ExplicitSchedule",
    "FinalOnlySchedule",
    "LinearSchedule",
    "MiniBatch",
    "OldestFirst",
    "PacedSelection",
    "ReadinessPredicate",
    "RelaxedSchedule",
    "Schedule",
    "SelectionPolicy",
    "Shortfall",
    "SourceQuota",
    "build_controller",
    "describe",
    "policy_config",
]
