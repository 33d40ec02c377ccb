"""The Megatron ordering contract: the deferred encoder backward must run before finalize_model_grads.

Real megatron-core DistributedDataParallel (with and without ``overlap_grad_reduce``) and the real
``finalize_model_grads`` on a 2-rank gloo world: wrapped by ``FinalizeWithDeferredBackward`` the
dedup gradients equal the re-encoding baseline's; run after finalize, megatron raises (overlap) or
the encoder gradients are never reduced (no overlap).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist import World
from torch import nn

from encoder_dedup.harness import _baseline_features, plan_for
from encoder_dedup.test_dedup import FP32_RTOL, MIXED
from encoder_dedup.toy import Layout, ToyBackbone, ToyEncoder, grpo_case, item_view, unit_inputs
from knitkit.encoder_dedup import DedupEncoder, FinalizeWithDeferredBackward, ProcessGroupTransport

CASE = grpo_case("ddp", Layout(dp=2), MIXED, n=4)


class _Vlm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.backbone = ToyEncoder(), ToyBackbone(megatron=False, tp=1)


def _ddp(overlap: bool) -> Any:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True
    )
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=None)
    return DistributedDataParallel(config, ddp_config, _Vlm())


def _micro_batches(rank: int, model: Any, step: Any) -> None:
    """Megatron's no-pipelining pattern: every micro-batch but the last under no_sync."""
    count = len(CASE.micro_batches[rank])
    for micro in range(count):
        if micro < count - 1:
            with model.no_sync():
                step(micro)
        else:
            step(micro)


def run_ordering(rank: int, overlap: bool, deferred_first: bool) -> dict[str, tuple[float, float]]:
    """Baseline vs dedup main_grads after finalize; dedup's backward before or after finalize."""
    from megatron.core.distributed import finalize_model_grads

    from knitkit.integration.megatron import cpu as megatron_cpu

    megatron_cpu.initialize_model_parallel()
    try:
        units = unit_inputs(CASE)
        views = [[item_view(CASE, p, 0) for p in mb] for mb in CASE.micro_batches[rank]]
        norm = float(sum(t.length for t in CASE.trajectories))

        base = _ddp(overlap)
        vlm = base.module

        def base_step(micro: int) -> None:
            feats, _ = _baseline_features(vlm.encoder, units, views[micro])
            vlm.backbone(views[micro], feats, None, norm).backward()

        _micro_batches(rank, base, base_step)
        finalize_model_grads([base])
        expected = {n: p.main_grad.clone() for n, p in vlm.named_parameters()}

        model = _ddp(overlap)
        vlm = model.module
        finalize = FinalizeWithDeferredBackward(finalize_model_grads)
        # NOTE: two mini-batches: with overlap_grad_reduce megatron learns which parameters get
        # gradients in the first one and checks it from the second on.
        for _ in range(2):
            model.zero_grad_buffer()
            dedup = DedupEncoder(plan_for(CASE).for_rank(rank), ProcessGroupTransport(), hidden=16)
            dedup.encode(lambda keys: vlm.encoder([units[k] for k in keys]))
            if deferred_first:
                finalize.arm(dedup)

            def dedup_step(micro: int, dedup: DedupEncoder = dedup) -> None:
                vlm.backbone(views[micro], dedup.features(micro), None, norm).backward()

            _micro_batches(rank, model, dedup_step)
            finalize([model])  # what Megatron's schedule calls after the last micro-batch
            if not deferred_first:
                dedup.backward()
        return {
            n: (float((p.main_grad - expected[n]).norm()), float(expected[n].norm()))
            for n, p in vlm.named_parameters()
        }
    finally:
        megatron_cpu.destroy_model_parallel()


@pytest.mark.parametrize("overlap", [False, True], ids=["no_overlap", "overlap_grad_reduce"])
def test_deferred_backward_before_finalize_matches_baseline(world2: World, overlap: bool) -> None:
    """Wrapped finalize: every main_grad equals the re-encoding baseline under real Megatron DDP."""
    for rank, report in enumerate(world2.run(run_ordering, overlap, True)):
        for name, (diff, norm) in report.items():
            assert norm > 0, name
            assert diff <= FP32_RTOL * norm + 1e-7, f"rank {rank} {name}: {diff:.3g} vs {norm:.3g}"


def test_deferred_backward_after_finalize_is_wrong_without_overlap(world2: World) -> None:
    """After finalize the encoder gradients miss the DP reduction: they differ from the baseline."""
    for report in world2.run(run_ordering, False, False):
        wrong = [n for n, (diff, norm) in report.items() if diff > 1e-3 * norm]
        assert wrong and all(n.startswith("encoder.") for n in wrong), wrong


def test_deferred_backward_after_finalize_fails_with_overlap(world2: World) -> None:
    """With overlap_grad_reduce, finalize before the encoder backward trips megatron's bucket check."""
    from dist import WorkerError

    with pytest.raises(WorkerError, match="Communication call has not been issued"):
        world2.run(run_ordering, True, False)


def test_finalize_runs_the_armed_backward_once_then_finalizes() -> None:
    """The wrapper runs the armed deferred backward, then before_finalize, then finalize, in order;
    a second arm before finalize is an error; an unarmed call only finalizes."""
    from encoder_dedup.test_dedup import CASES
    from knitkit.encoder_dedup import LocalTransport

    case = CASES["n1_nothing_to_dedup"]
    encoder, units = ToyEncoder(), unit_inputs(case)
    calls: list[tuple[str, bool]] = []
    dedup = DedupEncoder(plan_for(case).for_rank(0), LocalTransport(), hidden=16)
    dedup.encode(lambda keys: encoder([units[k] for k in keys]))
    for micro in range(len(dedup.route.micro_batch_index)):
        dedup.features(micro).sum().backward()

    def finalize(*args: object) -> tuple[object, ...]:
        calls.append(("finalize", encoder.patch.weight.grad is not None))
        return args

    def before() -> None:
        calls.append(("before", dedup.phase.value == "done"))

    hook = FinalizeWithDeferredBackward(finalize, before_finalize=before)
    hook.arm(dedup)
    with pytest.raises(RuntimeError, match="already armed"):
        hook.arm(dedup)
    assert hook("model") == ("model",)
    assert calls == [("before", True), ("finalize", True)]
    hook("model")
    assert calls[-1] == ("finalize", True) and len(calls) == 3
