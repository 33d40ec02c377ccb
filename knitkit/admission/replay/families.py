"""Trace families admission was not tuned on: heavy tails, a rare slow source, mild spread,
completion quotas with truncation, two competing quotas (``benchmarks/admission.py --families``)."""

from __future__ import annotations

from knitkit.admission.replay.settings import Preset, ReplaySettings
from knitkit.admission.replay.trace import SourceProfile

# Each family is a workload shape, not a tuned point: settings are the
# replay defaults except what defines the family (quotas, issue shares, caps); every quota is
# feedable (issue share >= lower-bound share), so a guarded policy must never violate.
FAMILIES: dict[str, Preset] = {
    "heavy_tail": Preset(
        profiles=(
            SourceProfile(name="A", median_s=20.0, sigma=1.2, cap_factor=30.0),
            SourceProfile(name="B", median_s=40.0, sigma=1.2, cap_factor=30.0),
            SourceProfile(name="C", median_s=80.0, sigma=1.2, cap_factor=30.0),
        ),
        settings=ReplaySettings(quota_ratios={"A": 0.3, "B": 0.3, "C": 0.3}, rollout_slots=128),
        group_size=1,
        description="three sources, log-normal sigma 1.2, tails up to 30x the median",
    ),
    "rare_slow": Preset(
        profiles=(
            SourceProfile(name="F1", median_s=12.5, sigma=0.1, cap_factor=1.2),
            SourceProfile(name="F2", median_s=12.5, sigma=0.1, cap_factor=1.2),
            SourceProfile(name="S", median_s=425.0, sigma=0.03, cap_factor=1.06),
        ),
        settings=ReplaySettings(
            quota_ratios={"F1": 0.4, "F2": 0.4, "S": 0.1},
            issue_shares={"F1": 0.4, "F2": 0.4, "S": 0.2},
            rollout_slots=128,
        ),
        group_size=1,
        description="a rare slow source (10% quota, ~400-450 s) beside two fast ones (10-15 s)",
    ),
    "mild_spread": Preset(
        profiles=tuple(
            SourceProfile(name=name, median_s=median, sigma=0.3)
            for name, median in (("A", 50.0), ("B", 60.0), ("C", 70.0), ("D", 80.0))
        ),
        settings=ReplaySettings(quota_ratios=dict.fromkeys("ABCD", 0.24), rollout_slots=128),
        group_size=1,
        description="four sources within 1.6x of each other, sigma 0.3",
    ),
    "completion_truncated": Preset(
        profiles=(
            SourceProfile(name="A", median_s=30.0, sigma=0.8, cap_factor=2.0),
            SourceProfile(name="B", median_s=120.0, sigma=0.8, cap_factor=2.0),
        ),
        settings=ReplaySettings(
            quota_ratios={"A": 0.4, "B": 0.4},
            completion_quota=0.6,
            rollout_slots=128,
        ),
        group_size=1,
        description="a 60% completion quota on the newest step; durations truncated at 2x median",
    ),
    "competing": Preset(
        profiles=(
            SourceProfile(name="A", median_s=30.0, sigma=0.6),
            SourceProfile(name="B", median_s=90.0, sigma=0.6),
            SourceProfile(name="C", median_s=10.0, sigma=0.6),
        ),
        settings=ReplaySettings(
            quota_ratios={"A": 0.45, "B": 0.45},
            quota_max_ratios={"C": 0.1},
            issue_shares={"A": 0.45, "B": 0.45, "C": 0.1},
            rollout_slots=128,
        ),
        group_size=1,
        description="two quotas of 45% competing for the batch, a fast third source capped at 10%",
    ),
}
