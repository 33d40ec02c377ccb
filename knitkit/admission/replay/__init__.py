"""Trace-replay simulator: replays a rollout trace under admission policies and measures staleness (paper 7)."""

from knitkit.admission.replay.families import FAMILIES
from knitkit.admission.replay.oracle import (
    BatchWindow,
    family_regret,
    offline_optimum,
    online_finish,
    regret_study,
)
from knitkit.admission.replay.plot import plot_replay
from knitkit.admission.replay.runner import ProgressBar, replay_preset, run_replay
from knitkit.admission.replay.settings import PRESETS, Preset, ReplaySettings, preset
from knitkit.admission.replay.trace import (
    SourceProfile,
    Trace,
    TraceRecord,
    generate_trace,
    read_jsonl,
    write_jsonl,
)

__all__ = [
    "FAMILIES",
    "PRESETS",
    "BatchWindow",
    "Preset",
    "ProgressBar",
    "ReplaySettings",
    "SourceProfile",
    "Trace",
    "TraceRecord",
    "family_regret",
    "generate_trace",
    "offline_optimum",
    "online_finish",
    "plot_replay",
    "preset",
    "read_jsonl",
    "regret_study",
    "replay_preset",
    "run_replay",
    "write_jsonl",
]
