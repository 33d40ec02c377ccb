"""One GRPO run's settings, shared by both data paths and the benchmark."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo.loss import LossConfig
from grpo.model import OptimConfig
from grpo.rollout import RolloutConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    """Rollout, admission, planning, loss and optimizer of one run."""

    steps: int = 3
    """Optimizer steps; one admitted mini-batch each."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train_batch_size: int = 32
    """Trajectories per train batch (one rollout step's worth by default)."""
    num_minibatches: int = 2
    quota_source: str = "geometry"
    quota_ratio: float = 0.5
    """knittrans keeps at least this share of every train batch from ``quota_source``."""
    max_tokens_per_micro_batch: int = 160
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    @property
    def minibatch_size(self) -> int:
        """Trajectories per mini-batch (GRPO's ``G`` in the sequence mean)."""
        return self.train_batch_size // self.num_minibatches

    def __post_init__(self) -> None:
        group = self.rollout.group_size
        if self.train_batch_size % self.num_minibatches or self.minibatch_size % group:
            raise ValueError(
                f"train_batch_size={self.train_batch_size} must split into {self.num_minibatches}"
                f" mini-batches of whole groups of {group}"
            )
