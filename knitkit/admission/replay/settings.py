"""Replay settings (the pipeline around a trace) and the named presets such as ``paper4``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from knitkit.admission import checks
from knitkit.admission.predicates import SourceQuota
from knitkit.admission.replay.trace import SourceProfile, Trace, generate_trace

PARTIAL_MODES = ("off", "drain", "abort_resume")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplaySettings:
    """How the simulated pipeline runs a trace; the same settings drive both architectures."""

    train_batch_size: int = 256
    num_minibatches: int = 4
    quota_ratios: Mapping[str, float] = field(default_factory=dict)
    """Lower-bound share of the train batch per source (e.g. 0.24 each in ``paper4``)."""
    quota_max_ratios: Mapping[str, float] = field(default_factory=dict)
    quota_specs: tuple[SourceQuota, ...] = ()
    """Full quotas (counts, ratios, groups); when given they replace the two ratio maps."""
    issue_shares: Mapping[str, float] | None = None
    """Share of each rollout step's prompts per source; ``None`` issues sources equally."""
    oversample: float = 0.25
    """Each rollout step issues ``(1 + oversample) * train_batch_size`` new trajectories."""
    issue_order: str = "round_robin"
    """'round_robin' interleaves sources in the issue queue; 'slow_first' queues the slowest first."""
    source_cap: float = 2.0
    """Per-source outstanding cap (queued + running + ready) in multiples of its per-step issue.

    A rollout step tops each source up to one step's issue (in-flight and ready leftovers
    count), so the pipeline stays stationary; a cap only binds below 1."""
    rollout_slots: int = 256
    """Trajectories generated concurrently; the rest wait in the issue queue."""
    rho: float = 0.8
    """Training time per train batch / mean colocated rollout-step length (sets the training time)."""
    sync_time_s: float = 0.0
    partial_rollout: str = "abort_resume"
    """'off' (colocated drops unfinished work), 'drain' (in-flight keeps its version), 'abort_resume'."""
    resume_penalty_s: float = 0.0
    max_ahead: int = 1
    """Rollout step r starts only once the rollout runs version >= r - max_ahead."""
    trainer_lookahead: int = 1
    """Train batch k opens once the trainer started train batch k - trainer_lookahead (pull)."""
    max_staleness: int | None = None
    """Admission drops trajectories older than this many versions (``AdmissionConfig``)."""
    completion_quota: float | None = None
    """Partial-rollout completion quota: share of the newest rollout step completed (readiness)."""
    dynamic_sampling_rounds: int = 10
    """Extra issue rounds a rollout step may add when rejected groups leave its train batch
    unable to fill (DAPO's dynamic sampling, ``max_num_gen_batches``); 0 turns it off."""
    group_atomic: bool = False
    """Admit whole GRPO groups atomically."""
    train_batches: int = 40
    warmup: int = 6
    """Train batches excluded from the staleness averages."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "num_minibatches", "rollout_slots", "train_batches"):
            checks.whole(getattr(self, name), name, minimum=1)
        for name in ("warmup", "max_ahead", "trainer_lookahead", "seed", "dynamic_sampling_rounds"):
            checks.whole(getattr(self, name), name)
        if self.max_staleness is not None:
            checks.whole(self.max_staleness, "max_staleness")
        checks.finite(self.rho, "rho", positive=True)
        checks.finite(self.source_cap, "source_cap", positive=True)
        for name in ("oversample", "sync_time_s", "resume_penalty_s"):
            checks.finite(getattr(self, name), name)
        for source, share in (self.issue_shares or {}).items():
            checks.finite(share, f"issue_shares[{source!r}]")
        if self.issue_shares is not None and not any(self.issue_shares.values()):
            raise ValueError(f"issue_shares={dict(self.issue_shares)}: no source is issued")
        for field_name in ("quota_ratios", "quota_max_ratios"):
            for source, value in getattr(self, field_name).items():
                checks.ratio(value, f"{field_name}[{source!r}]")
        if self.completion_quota is not None:
            checks.ratio(self.completion_quota, "completion_quota")
        if self.partial_rollout not in PARTIAL_MODES:
            raise ValueError(
                f"partial_rollout={self.partial_rollout!r}; choose from {PARTIAL_MODES}"
            )
        if self.issue_order not in ("round_robin", "slow_first"):
            raise ValueError(f"issue_order={self.issue_order!r}; use 'round_robin' or 'slow_first'")
        if not 1 <= self.warmup < self.train_batches:
            raise ValueError(
                f"warmup={self.warmup}, train_batches={self.train_batches}: need 1 <= warmup "
                f"< train_batches (train_batches must exceed warmup)"
            )

    def quotas(self) -> tuple[SourceQuota, ...]:
        if self.quota_specs:
            return self.quota_specs
        names = dict.fromkeys([*self.quota_ratios, *self.quota_max_ratios])
        return tuple(
            SourceQuota(
                source=s,
                min_ratio=self.quota_ratios.get(s),
                max_ratio=self.quota_max_ratios.get(s),
            )
            for s in names
        )

    def with_(self, **changes: object) -> ReplaySettings:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Preset:
    """A named workload: source duration profiles plus the pipeline settings that go with them."""

    profiles: tuple[SourceProfile, ...]
    settings: ReplaySettings
    group_size: int
    description: str

    def trace(self, settings: ReplaySettings | None = None) -> Trace:
        """A trace long enough for ``settings`` (default: the preset's), seeded by ``settings.seed``."""
        s = settings or self.settings
        share = max((s.issue_shares or {}).values(), default=1.0 / len(self.profiles))
        prompts = s.train_batch_size * (1 + s.oversample) / self.group_size * share
        per_source = int(prompts * (s.train_batches + 4) * (1 + s.source_cap)) + 8
        return generate_trace(
            self.profiles, samples_per_source=per_source, group_size=self.group_size, seed=s.seed
        )


# paper4 calibration: four sources, 24% of the train batch each (lower bounds, 4% slack),
# means spread about 10x like the paper's Figure 3(a) (A ~0.3 ks ... D ~3 ks). Each rollout step
# issues 1.15x a train batch (GRPO groups of 8, trajectories admitted one by one), slowest source
# first, into 104 rollout slots; partial rollouts abort and resume at each sync. These free knobs
# were set so that under `linear` the first mini-batch lands at ~0.75-0.8 of the interval from
# rollout-step start to final admission, the observable of the paper's Figure 3(b) ("nearly
# 80%"), with rho = 0.85 inside the regime the design describes (knitkit/admission/README.md). Staleness figures are outputs
# of the replay; the admission README says how the knobs were chosen (and what else was seen).
PRESETS: dict[str, Preset] = {
    "paper4": Preset(
        profiles=(
            SourceProfile(name="A", median_s=250.0, sigma=0.6, cap_factor=4.0),
            SourceProfile(name="B", median_s=500.0, sigma=0.6, cap_factor=4.0),
            SourceProfile(name="C", median_s=800.0, sigma=0.6, cap_factor=3.0),
            SourceProfile(name="D", median_s=3000.0, sigma=0.15, cap_factor=8.0),
        ),
        settings=ReplaySettings(
            quota_ratios={"A": 0.24, "B": 0.24, "C": 0.24, "D": 0.24},
            oversample=0.15,
            source_cap=1.0,
            rollout_slots=104,
            issue_order="slow_first",
            rho=0.85,
        ),
        group_size=8,
        description="four sources at 24% each, ~10x spread of per-source durations (Figure 3(a))",
    ),
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
