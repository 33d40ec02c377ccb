"""GRPO on a megatron-core MoE GPTModel with routing replay (R3): ``grpo_megatron.py --moe``.

Rank 0 hosts the driver; a rollout stand-in writes GRPO groups (prompt + response tokens, each
response's group-normalised advantage). Each mini-batch runs two passes on every rank:
``rollout``, a forward-only pass of the behaviour policy (the policy as it was when the train
batch was rolled out) that records every token's experts, layer by layer, and writes them back as
the ``routing`` field (SGLang's ``routed_experts`` in a real run); then ``train``, where
``MegatronRank(routing=RoutingReplay(policy))`` hands each micro-batch's stored routing to
megatron-core's ``RouterReplay``, so the policy is trained with the experts the rollout chose,
also after the first mini-batch's update moved its routers. Each step prints the loss and the
share of (token, layer) routings where replay overrode the policy's own choice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import megatron_common as common
import numpy as np
import torch
import torch.distributed as dist
from megatron.core.parallel_state import get_tensor_model_parallel_world_size

from grpo.model import MainGradAdamW, OptimConfig
from grpo.rewards import group_advantages, reward, rule
from knitkit.admission import build_controller
from knitkit.integration.megatron import (
    MegatronLayout,
    MegatronRank,
    RoutingReplay,
    cpu,
    megatron_batch,
)
from knitkit.job import Driver, Output, Pass, RankSpec, broadcast_rank_spec
from knitkit.next_token import next_token_fields
from knitkit.storage import PlannerConfig, Topology, Trajectory

LAYERS, EXPERTS, TOPK, VOCAB, HIDDEN = 4, 8, 2, 64, 32
ROLLOUT = ("tokens", "labels", "loss_mask")
PASSES = (
    Pass(
        "rollout",
        reads=ROLLOUT,
        writes=(Output("routing", "uint8", (LAYERS, TOPK)),),
        forward_only=True,
    ),
    Pass("train", reads=(*ROLLOUT, "advantage", "routing")),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    """One MoE GRPO run."""

    steps: int = 2
    """Train batches."""
    num_minibatches: int = 2
    groups: int = 4
    """Prompts per train batch."""
    group_size: int = 4
    lr: float = 1e-2


def build_policy() -> Any:
    """A megatron-core MoE GPTModel (local spec, 8 experts, top-2, routing replay on) in Megatron
    DDP; seeded, so every call builds the same weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    tp = get_tensor_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=HIDDEN,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_enable_routing_replay=True,
        sequence_parallel=tp > 1,  # megatron refuses MoE training at TP > 1 without it
        add_bias_linear=False,
        bias_dropout_fusion=False,
        **common.tiny_config_fields(),
    )
    torch.manual_seed(1234)
    model = GPTModel(config, cpu.moe_block_spec(EXPERTS)(LAYERS), VOCAB, 256)
    return common.megatron_ddp(model, config)


def rollout(step: int, config: MoEConfig) -> list[Trajectory]:
    """The rollout stand-in: ``groups`` prompts x ``group_size`` responses, rewarded by
    ``grpo.rewards.reward`` and given their group-normalised advantage."""
    rng = np.random.default_rng(step)
    out = []
    for g in range(config.groups):
        prompt = rng.integers(4, VOCAB, int(rng.integers(6, 12)))
        responses = [
            _response(rng, int(prompt[-1]), i / max(config.group_size - 1, 1))
            for i in range(config.group_size)
        ]
        advantages = group_advantages([reward(r.tolist(), VOCAB) for r in responses])
        for i, (response, advantage) in enumerate(zip(responses, advantages, strict=True)):
            tokens = np.concatenate([prompt, response]).astype(np.int32)
            mask = (np.arange(len(tokens)) >= len(prompt)).astype(np.uint8)
            fields = next_token_fields({"tokens": tokens, "loss_mask": mask})
            out.append(
                Trajectory(
                    f"s{step}-{g}-{i}",
                    f"s{step}-{g}",
                    fields,
                    scalars={"advantage": np.float32(advantage)},
                    source="moe",
                    rollout_step=step,
                )
            )
    return out


def _response(rng: np.random.Generator, last: int, follow: float) -> np.ndarray:
    """A response following ``grpo.rewards.rule`` with probability ``follow`` (varied rewards)."""
    out = []
    for _ in range(int(rng.integers(8, 20))):
        last = rule(last, VOCAB) if rng.random() < follow else int(rng.integers(4, VOCAB))
        out.append(last)
    return np.asarray(out)


def _forward_step(
    data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    """Policy gradient on the trained tokens: advantage x NLL of each label, masked mean."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    mask = batch["loss_mask"]
    advantage = batch.get("advantage", torch.zeros_like(mask))

    def loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        value = (output.float() * advantage * mask).sum() / mask.sum().clamp(min=1)
        return value, {"loss": value.detach().clone()}

    return output, loss


class Overrides:
    """Counts the (token, layer) routings where replay differs from the policy's own top-k
    (real tokens only: a packing pad row replays expert 0 twice, so it routes to one expert)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.changed = self.total = 0
        self._routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self._hooks: list[Any] = []

    def __enter__(self) -> Overrides:
        self._hooks = [r.register_forward_hook(self._count) for r in self._routers]
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()

    def _count(self, router: Any, args: tuple[torch.Tensor, ...], out: Any) -> None:
        with torch.no_grad():
            logits = router.gating(args[0]).reshape(-1, EXPERTS)
            own = torch.zeros_like(out[1]).scatter(1, torch.topk(logits, TOPK).indices, True)
        real = out[1].sum(dim=1) == TOPK
        self.changed += int(((own != out[1]).any(dim=1) & real).sum())
        self.total += int(real.sum())


def start_driver(config: MoEConfig, topology: Topology) -> Driver:
    """The driver (global rank 0): admission, store, planner, reorganizers; every train batch's
    trajectories written by the rollout stand-in."""
    size = config.groups * config.group_size
    admission = build_controller(
        "streaming", train_batch_size=size, num_minibatches=config.num_minibatches, sources=["moe"]
    )
    driver = Driver.Config(
        passes=PASSES, topology=topology, planner=PlannerConfig(min_micro_batches=2)
    ).build(admission=admission)
    for step in range(config.steps):
        for trajectory in rollout(step, config):
            driver.write(trajectory)
    driver.finish()
    return driver


def train(spec: RankSpec, config: MoEConfig) -> list[dict[str, float]]:
    """Every rank: the policy, its behaviour copy and optimizer, then every pass it is served."""
    cpu.install_moe_shim()
    policy, behaviour = build_policy(), build_policy()
    for param in behaviour.parameters():
        param.requires_grad_(False)
    optimizer = MainGradAdamW(policy, OptimConfig(lr=config.lr))
    return _passes(spec, config, policy, behaviour, optimizer)


def moe_loop(config: MoEConfig) -> list[dict[str, float]]:
    """Every rank of the world: the driver on rank 0, then each mini-batch's two passes."""
    sequence_parallel = get_tensor_model_parallel_world_size() > 1
    layout = MegatronLayout.from_parallel_state(sequence_parallel=sequence_parallel)
    driver = start_driver(config, layout.topology) if dist.get_rank() == 0 else None
    try:
        history = train(broadcast_rank_spec(driver.rank_spec() if driver else None), config)
        if driver is not None:
            driver.drain(120)
    finally:
        if driver is not None:
            driver.close()
    return history


def _passes(
    spec: RankSpec, config: MoEConfig, policy: Any, behaviour: Any, optimizer: MainGradAdamW
) -> list[dict[str, float]]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    recorder = RoutingReplay(behaviour)
    to_batch = functools.partial(megatron_batch, attention_mask=True)
    sp = policy.config.sequence_parallel
    schedule = get_forward_backward_func()
    history: list[dict[str, float]] = []
    rollouts = 0
    with MegatronRank.from_parallel_state(
        spec, to_batch=to_batch, sequence_parallel=sp, routing=RoutingReplay(policy)
    ) as rank:
        for work in rank.passes():
            run = functools.partial(
                schedule,
                data_iterator=work.data_iterator(),
                num_microbatches=work.num_micro_batches,
                seq_length=256,
                micro_batch_size=1,
                forward_only=work.forward_only,
            )
            with work:
                if work.forward_only:  # the rollout stand-in's forward: record its routing
                    if rollouts % config.num_minibatches == 0:  # a new train batch rolls out
                        behaviour.load_state_dict(policy.state_dict())
                    rollouts += 1
                    try:
                        run(forward_step_func=recorder.recording(_forward_step), model=[behaviour])
                        work.write_back_routing(recorder)
                    finally:
                        recorder.clear()
                    continue
                policy.zero_grad_buffer()
                with Overrides(policy) as overrides:
                    losses = run(forward_step_func=work.forward_step(_forward_step), model=[policy])
                optimizer.step()
                loss = float(sum(float(out["loss"]) for out in losses))
                history.append(
                    {"loss": loss, "overridden": overrides.changed / max(overrides.total, 1)}
                )
                if dist.get_rank() == 0:
                    print(
                        f"{work.minibatch_id}: loss {loss:+.5f}, replay overrode "
                        f"{history[-1]['overridden']:.1%} of the policy's own routings",
                        flush=True,
                    )
    return history


def moe_main(steps: int) -> list[dict[str, float]]:
    """``grpo_megatron.py --moe``: the loop in this torchrun world (TP = the world size)."""
    with common.megatron_world():
        return moe_loop(MoEConfig(steps=steps))
