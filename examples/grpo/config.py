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
    """GRPO steps; one admitted mini-batch each, trained ``ppo_epochs`` times."""
    ppo_epochs: int = 2
    """Optimizer steps per mini-batch (PPO epochs), each over all of its micro-batches against
    the old log-probs computed once before the first: from the second on the policy has moved,
    so the ratio leaves 1 and the clip binds (``clipped`` > 0)."""
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
        if self.ppo_epochs < 1:
            raise ValueError(f"ppo_epochs={self.ppo_epochs}; each mini-batch trains at least once")
        group = self.rollout.group_size
        if self.train_batch_size % self.num_minibatches or self.minibatch_size % group:
            raise ValueError(
                f"train_batch_size={self.train_batch_size} must split into {self.num_minibatches}"
                f" mini-batches of whole groups of {group}"
            )
