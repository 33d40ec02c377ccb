"""Constraint-preserving mini-batch admission (paper 5.1) and the trace-replay simulator."""

from knitkit.admission.config import AdmissionConfig
from knitkit.admission.controller import AdmissionController, AdmissionStats, MiniBatch
from knitkit.admission.oracle import BatchWindow, offline_optimum, online_finish, regret_study
from knitkit.admission.policies import POLICY_NAMES, build_controller, describe, policy_config
from knitkit.admission.predicates import (
    AdmissionView,
    CompletionQuota,
    ReadinessPredicate,
    SourceQuota,
)
from knitkit.admission.replay import ProgressBar, replay_preset, run_replay
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
from knitkit.admission.settings import PRESETS, Preset, ReplaySettings, preset
from knitkit.admission.trace import (
    SourceProfile,
    Trace,
    TraceRecord,
    generate_trace,
    read_jsonl,
    write_jsonl,
)

__all__ = [
    "POLICY_NAMES",
    "PRESETS",
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionStats",
    "AdmissionView",
    "BarrierSchedule",
    "BatchWindow",
    "CandidateRequest",
    "CompletionQuota",
    "ExplicitSchedule",
    "FinalOnlySchedule",
    "LinearSchedule",
    "MiniBatch",
    "OldestFirst",
    "PacedSelection",
    "Preset",
    "ProgressBar",
    "ReadinessPredicate",
    "RelaxedSchedule",
    "ReplaySettings",
    "Schedule",
    "SelectionPolicy",
    "SourceProfile",
    "SourceQuota",
    "Trace",
    "TraceRecord",
    "build_controller",
    "describe",
    "generate_trace",
    "offline_optimum",
    "online_finish",
    "policy_config",
    "preset",
    "read_jsonl",
    "regret_study",
    "replay_preset",
    "run_replay",
    "write_jsonl",
]
