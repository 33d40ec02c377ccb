"""Forward-only dedup (old and reference log-probs) against the unwrapped forward-only schedule, on gloo.

An RL step runs forward-only passes over the same images before training: old log-probs with the
policy, reference log-probs with a frozen reference model whose encoder is a different module.
``DedupVLMStep(model).run(..., forward_only=True)`` encodes each unique image once in the world
(no graph kept, no gradient return route) and serves the cached rows to every (DP, TP) consumer.
Each pass is checked with ``knitkit.integration.megatron.testing.check_equivalence`` (its
forward-only pass runs ``logprob_step``): the reference is ``get_forward_backward_func()(
forward_only=True)`` with every micro-batch re-encoding the images its placeholder tokens
consume; the check also asserts that the forward-only pass keeps no encoder graph, leaves no
gradient and encodes each unique image once.

Tolerance: log-probs must be bitwise identical. Both paths compute each image's features with the
same ops on the same inputs (one image per ``encode`` call) and the backbone sees identical
``decoder_input``; measured worst |difference| is 0 at DP2 and DP2 x TP2. (The check's training
pass is held to its fp32 defaults, every reference gradient above the floor.)
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import World

from knitkit.encoder_dedup import EquivalenceReport
from knitkit.integration.megatron import cpu as megatron_cpu
from knitkit.integration.megatron.testing import VLMUnderTest, check_equivalence

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import megatron_wrap as user

WORLD_TIMEOUT_S = 240.0
"""Default limit of one job on this module's lent worlds (``world2``/``world4`` in tests/conftest.py)."""


def _logprobs(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss function of a log-prob pass: per-token log-probs (``-cross entropy``) of the labels."""
    return output.sum(), {"logprobs": -output.detach().float().reshape(-1)}


def logprob_step(
    data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    """The user's forward step of an old/reference log-prob pass (verl's compute_log_prob)."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        batch["labels"],
        images=batch.get("images"),
    )
    return output, _logprobs


def perturbed_model(seed: int) -> Any:
    """A reference model: same architecture, different weights (its encoder is a different module)."""
    model = user.build_model(False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.module.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def _forward_only(rank: int, tensor_parallel: int) -> dict[str, EquivalenceReport]:
    """One rank: the old (policy) and the reference model, each checked with its log-prob pass."""
    megatron_cpu.initialize_model_parallel(tensor_parallel=tensor_parallel)
    megatron_cpu.install_schedule_shim()
    try:
        providers = {
            "old": functools.partial(user.build_model, False),
            "ref": functools.partial(perturbed_model, 7),
        }
        return {
            name: check_equivalence(
                VLMUnderTest(
                    provider=provider,
                    forward_step=user.forward_step,
                    forward_only_step=logprob_step,
                ),
                functools.partial(user.grpo_trajectories, 0),
            )
            for name, provider in providers.items()
        }
    finally:
        megatron_cpu.destroy_model_parallel()


def _check(results: list[dict[str, EquivalenceReport]]) -> None:
    reports = results[0]
    logprobs = {}
    for name, report in reports.items():
        print(report.table())
        report.raise_if_failed(expect_below_floor=())
        row = next(c for c in report.outputs if c.name == "forward_only[logprobs]")
        assert row.max_abs_diff == 0.0, f"{name}: log-probs differ by {row.max_abs_diff}"
        logprobs[name] = row.max_abs_ref
    assert logprobs["old"] != logprobs["ref"], (
        "old and reference models must give different log-probs"
    )


def test_dp2_forward_only_logprobs_match_unwrapped(world2: World) -> None:
    """DP=2: old and reference log-probs equal the re-encoding forward; each image encoded once per pass."""
    _check(world2.run(_forward_only, 1))


@pytest.mark.slow
def test_dp2_tp2_forward_only_logprobs_match_unwrapped(world4: World) -> None:
    """DP=2 x TP=2: the same, with rows routed to both TP replicas of each DP rank."""
    _check(world4.run(_forward_only, 2))


def test_forward_only_encoder_keeps_no_graph_and_refuses_backward() -> None:
    """``DedupEncoder.encode(keep_graph=False)``: no graph, no gradient buffer, plain gathers, no backward."""
    from knitkit.encoder_dedup import (
        BackboneAssignment,
        DedupEncoder,
        EncoderAssignment,
        LocalTransport,
        RowSlice,
        build_routing_plan,
    )
    from knitkit.types import UnitKey

    key = UnitKey("img", "image")
    plan = build_routing_plan(
        EncoderAssignment({0: [[key]]}, {key: 3}),
        BackboneAssignment({0: [[RowSlice(key, 0, 2)], [RowSlice(key, 1, 3)]]}),
        world_size=1,
    )
    weight = torch.nn.Parameter(torch.randn(4, 4))
    dedup = DedupEncoder(plan.for_rank(0), LocalTransport(), hidden=4)
    dedup.encode(lambda keys: torch.ones(3, 4) @ weight, keep_graph=False)
    rows = torch.ones(3, 4) @ weight.detach()
    assert torch.equal(dedup.features(0), rows[0:2]) and torch.equal(dedup.features(1), rows[1:3])
    assert not dedup.features(0).requires_grad
    assert dedup.cache_grad.numel() == 0
    with pytest.raises(RuntimeError, match="forward-only"):
        dedup.backward()
