"""The policy, its frozen reference and the optimizer: megatron-core's where it runs, torch.optim over ``main_grad`` on CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import megatron_wrap
import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """Adam, as megatron-core's ``OptimizerConfig(optimizer="adam")`` runs it."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


def build_models() -> tuple[Any, Any]:
    """The policy and its frozen reference: megatron_wrap's tiny VLM (GPTModel + vision path in
    Megatron DDP), built twice from the same seed, so the reference is the initial policy."""
    policy = megatron_wrap.build_model(overlap_grad_reduce=False)
    reference = megatron_wrap.build_model(overlap_grad_reduce=False)
    for param in reference.parameters():
        param.requires_grad_(False)
    return policy, reference


class MainGradAdamW:
    """``torch.optim.AdamW`` over Megatron DDP's ``main_grad``: the CPU stand-in for megatron's optimizer.

    NOTE [ Optimizer on CPU ]: megatron-core 0.16.1's optimizers allocate CUDA tensors when
    built (``FP32Optimizer`` keeps its loss scale with ``device="cuda"``, the distributed
    optimizer checks ``torch.cuda.FloatTensor``), so on a machine without CUDA the example
    steps with ``torch.optim.AdamW`` itself. That is what megatron-core's fp32 optimizer runs
    when neither apex nor Transformer Engine is installed, after the same preparation: each
    parameter's ``grad`` is set to Megatron DDP's reduced ``main_grad``. Weight decay 0 and no
    gradient clipping on both, so the CPU and the GPU step compute the same update.
    """

    def __init__(self, model: torch.nn.Module, config: OptimConfig) -> None:
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._optimizer = torch.optim.AdamW(
            self._params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=0.0
        )

    @torch.no_grad()
    def step(self) -> None:
        for param in self._params:
            param.grad = param.main_grad  # type: ignore[attr-defined]
        self._optimizer.step()
        for param in self._params:
            param.grad = None

    def state_dict(self) -> dict[str, Any]:
        """Adam's moments and step counts (``torch.optim`` convention: tensors and plain data)."""
        return self._optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state)


def build_optimizer(model: Any, config: OptimConfig) -> Any:
    """megatron-core's Adam over the DDP model with CUDA; ``MainGradAdamW`` without (NOTE [ Optimizer on CPU ])."""
    if not torch.cuda.is_available():
        return MainGradAdamW(model, config)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            adam_beta1=config.betas[0],
            adam_beta2=config.betas[1],
            adam_eps=config.eps,
            weight_decay=0.0,
            clip_grad=0.0,
            params_dtype=torch.float32,
        ),
        [model],
    )
