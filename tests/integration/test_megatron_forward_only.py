"""Forward-only dedup (old and reference log-probs) against the unwrapped forward-only schedule, on gloo.

An RL step runs forward-only passes over the same images before training: old log-probs with the
policy, reference log-probs with a frozen reference model whose encoder is a different module.
``DedupVLMStep(model).run(..., forward_only=True)`` encodes each unique image once in the world
(no graph kept, no gradient return route) and serves the cached rows to every (DP, TP) consumer.
The reference is ``get_forward_backward_func()(forward_only=True)`` with every micro-batch
re-encoding the images its placeholder tokens consume.

Tolerance: log-probs must be bitwise identical. Both paths compute each image's features with the
same ops on the same inputs (one image per ``encode`` call) and the backbone sees identical
``decoder_input``; measured worst |difference| is 0 at DP2 and DP2 x TP2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import megatron_cpu
import pytest
import torch
from dist import World

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import megatron_wrap as user


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


def _perturbed(model: Any, seed: int) -> Any:
    """A reference model: same architecture, different weights (its encoder is a different module)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.module.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def _forward_only(rank: int, tensor_parallel: int) -> dict[str, Any]:
    """One rank: old and reference log-probs, unwrapped vs deduplicated, plus what dedup did."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from knitkit.integration.megatron import DedupVLMStep, MegatronLayout, feature_slices
    from knitkit.storage import MemoryBackend, TrajectoryStore

    megatron_cpu.initialize_model_parallel(tensor_parallel=tensor_parallel)
    megatron_cpu.install_schedule_shim()
    try:
        layout = MegatronLayout.from_parallel_state()
        store = TrajectoryStore(MemoryBackend())
        trajectories = user.grpo_trajectories(seed=0)
        for trajectory in trajectories:
            store.write(trajectory)
        plan = user.plan_step(store, [t.trajectory_id for t in trajectories], layout)
        route = layout.route(plan)
        consumer = plan.consumer(*layout.coord[:2])
        models = {"old": user.build_model(False), "ref": _perturbed(user.build_model(False), 7)}
        for model in models.values():
            model.config.finalize_model_grads_func = None  # inference models have no finalize

        def pixels(key):  # type: ignore[no-untyped-def]
            return torch.from_numpy(store.read(key))

        result: dict[str, Any] = {"worst": 0.0, "encoded": 0, "graph": False, "grads": False}
        logprobs: dict[str, torch.Tensor] = {}
        for name, model in models.items():
            vision = model.module.vision
            encoded_keys: list[object] = []

            def encode(keys, vision=vision, encoded_keys=encoded_keys):  # type: ignore[no-untyped-def]
                encoded_keys.extend(keys)
                rows = torch.cat([vision.encode(pixels(k)) for k in keys])
                result["graph"] = result["graph"] or rows.requires_grad
                return rows

            iterator, data = user.knitkit_batches(store, plan, layout)
            with iterator, torch.no_grad():
                pieces = [feature_slices(mb) for mb in consumer.micro_batches]
                with_images = (
                    dict(batch, images=[(pixels(s.key), s.start, s.stop) for s in piece])
                    for batch, piece in zip(data, pieces, strict=True)
                )
                expected = get_forward_backward_func()(
                    forward_step_func=logprob_step,
                    data_iterator=with_images,
                    model=[model],
                    num_microbatches=plan.num_micro_batches,
                    seq_length=user.MAX_SEQ,
                    micro_batch_size=1,
                    forward_only=True,
                )
            iterator, data = user.knitkit_batches(store, plan, layout)
            step = DedupVLMStep(model, vision="vision")
            with iterator:  # no torch.no_grad(): the encoder must keep no graph on its own
                got = step.run(
                    forward_step_func=logprob_step,
                    data_iterator=data,
                    route=route,
                    encode_fn=encode,
                    num_microbatches=plan.num_micro_batches,
                    seq_length=user.MAX_SEQ,
                    micro_batch_size=1,
                    forward_only=True,
                )
            assert len(got) == len(expected) == plan.num_micro_batches
            for mine, ref in zip(got, expected, strict=True):
                diff = (mine["logprobs"] - ref["logprobs"]).abs().max()
                result["worst"] = max(result["worst"], float(diff))
            logprobs[name] = torch.cat([out["logprobs"] for out in got])
            result["encoded"] += len(encoded_keys)
            result["grads"] = result["grads"] or any(
                p.grad is not None or bool(p.main_grad.abs().sum() > 0) for p in vision.parameters()
            )
            result["restored"] = type(vision) is user.VisionPath and model.module.vision is vision
        result["models_differ"] = not torch.equal(logprobs["old"], logprobs["ref"])
        return result
    finally:
        megatron_cpu.destroy_model_parallel()


def _check(results: list[dict[str, Any]], passes: int = 2) -> None:
    for rank, result in enumerate(results):
        assert result["worst"] == 0.0, f"rank {rank}: log-probs differ by {result['worst']}"
        assert not result["graph"], f"rank {rank}: the forward-only encoder kept a graph"
        assert not result["grads"], f"rank {rank}: a forward-only pass left vision gradients"
        assert result["restored"], f"rank {rank}: the vision path was not restored"
        assert result["models_differ"], "old and reference models must give different log-probs"
    unique = len({i.key for t in user.grpo_trajectories(0) for i in t.multimodal})
    encoded = sum(r["encoded"] for r in results)
    assert encoded == unique * passes, f"{encoded} encodings for {unique} unique images x {passes}"


@pytest.fixture(scope="module")
def world2() -> Iterator[World]:
    with World(2, timeout_s=240) as world:
        yield world


@pytest.fixture(scope="module")
def world4() -> Iterator[World]:
    with World(4, timeout_s=240) as world:
        yield world


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
