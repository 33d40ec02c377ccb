"""Dedup VLM step under pipeline parallelism (PP=2 x DP=2 on gloo) against the unwrapped schedule.

The model is the example's VLM cut into two pipeline stages: the first holds the vision path, the
embedding and one transformer layer, the second the other layer and the output head (with two
virtual chunks per stage: four one-layer chunks, the vision path in the first stage's first
chunk; those interleaved-schedule tests need 4 GPUs: megatron's interleaved schedule with
variable-length micro-batches does not run on gloo p2p). The reference is megatron's 1F1B
schedule (interleaved with virtual chunks) with every micro-batch re-encoding its images on the
first stage; the wrapped step is ``DedupVLMStep``: only first-stage ranks encode (each unique image once in the stage), serve cached rows and run the
deferred encoder backward before the first stage's ``finalize_model_grads``.

Each case is ``knitkit.integration.megatron.testing.check_equivalence`` with the chunks as the
provider (rows named ``stage{s}.[chunk{c}.]<parameter>``). Tolerance (fp32), per parameter on each
stage: ``max|g_wrapped - g_ref| <= 1e-4 * max(max|g_ref|, 1e-6)`` (summation order only, as at
PP=1); every reference gradient is above the floor and the worst relative error is asserted.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import World
from unwrapped_batches import with_images

from knitkit.encoder_dedup import EquivalenceReport
from knitkit.integration.megatron import cpu as megatron_cpu
from knitkit.integration.megatron import current_device
from knitkit.integration.megatron.testing import VLMUnderTest, check_equivalence
from knitkit.storage import PlannerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import megatron_wrap as user

WORLD_TIMEOUT_S = 300.0
"""Default limit of one job on this module's lent worlds (``world2``/``world4`` in tests/conftest.py)."""

RTOL, FLOOR = 1e-4, 1e-6
STEPS, LR = 2, 0.5


def build_pipelined_chunks(overlap_grad_reduce: bool, virtual: int | None = None) -> list[Any]:
    """This rank's model chunks of the example VLM at PP=2 (``virtual`` chunks per stage under
    the interleaved schedule, one transformer layer each), each in Megatron DDP, sharing one
    config (seeded: the same on every call)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import MegatronModule, TransformerConfig

    pp = ps.get_pipeline_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=pp * (virtual or 1),
        hidden_size=user.HIDDEN,
        num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual,
        pipeline_dtype=torch.float32,
        variable_seq_lengths=True,  # packed micro-batches differ in length
        moe_token_dispatcher_type="alltoall",  # required with variable_seq_lengths (no MoE here)
        batch_p2p_comm=False,  # the batched p2p path synchronises CUDA
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )

    class PipelinedVLM(MegatronModule):
        def __init__(self, vp_stage: int | None) -> None:
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder
            self.pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            self.post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
            self.share_embeddings_and_output_weights = False
            if self.pre_process:
                self.vision = user.VisionPath()
            self.language_model = GPTModel(
                config,
                get_gpt_layer_local_spec(),
                user.VOCAB,
                user.MAX_SEQ,
                pre_process=self.pre_process,
                post_process=self.post_process,
                position_embedding_type="rope",
                vp_stage=vp_stage,
            )

        def set_input_tensor(self, tensor: torch.Tensor) -> None:
            self.language_model.set_input_tensor(tensor)

        def forward(
            self,
            tokens: torch.Tensor,
            position_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            labels: torch.Tensor,
            images: list[tuple[torch.Tensor, int, int]] | None = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            embeddings = None
            if self.pre_process:
                embeddings = self.language_model.embedding(
                    input_ids=tokens, position_ids=position_ids
                )
                features = self.vision(images)
                at_image = (tokens == user.IMAGE_TOKEN).t().unsqueeze(-1).expand_as(embeddings)
                embeddings = embeddings.masked_scatter(at_image, features)
            return self.language_model(
                tokens,
                position_ids,
                attention_mask,
                decoder_input=embeddings,
                labels=labels,
                packed_seq_params=packed_seq_params,
            )

    torch.manual_seed(1234)
    stages = [None] if virtual is None else list(range(virtual))
    chunks = [
        DistributedDataParallel(
            config,
            DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce),
            PipelinedVLM(stage).to(current_device()),
            disable_bucketing=i > 0,  # as megatron's training loop wraps later chunks
        )
        for i, stage in enumerate(stages)
    ]
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync if virtual else no_sync[0]
    config.finalize_model_grads_func = finalize_model_grads
    return chunks


def _equivalence(
    rank: int, overlap: bool, virtual: int | None, pipeline: int = 2
) -> EquivalenceReport:
    """One rank of ``check_equivalence`` on the pipelined chunks (twin builds, two mini-batches)."""
    from megatron.core import parallel_state as ps

    megatron_cpu.initialize_model_parallel(pipeline_parallel=pipeline)
    if virtual is not None:
        ps.set_virtual_pipeline_model_parallel_world_size(virtual)
    megatron_cpu.install_pipeline_shim()
    try:
        return check_equivalence(
            VLMUnderTest(
                provider=functools.partial(build_pipelined_chunks, overlap, virtual),
                forward_step=user.forward_step,
                reference_batches=with_images,
            ),
            functools.partial(user.grpo_trajectories, 0),
            rtol=RTOL,
            floor=FLOOR,
            steps=STEPS,
            lr=LR,
            # The interleaved schedule runs micro-batches in groups of PP: plan a multiple of it.
            planner=PlannerConfig(token_fields=("tokens",), scalar_fields=(), min_micro_batches=4),
        )
    finally:
        megatron_cpu.destroy_model_parallel()


def _disagreeing_counts(rank: int) -> str:
    """Stages pass different micro-batch counts: every rank gets the error (no p2p hang)."""
    from megatron.core import parallel_state as ps

    from knitkit.integration.megatron import check_microbatches_agree

    megatron_cpu.initialize_model_parallel(pipeline_parallel=2)
    try:
        try:
            check_microbatches_agree(3 + ps.get_pipeline_model_parallel_rank())
        except ValueError as error:
            return str(error)
        return "no error"
    finally:
        megatron_cpu.destroy_model_parallel()


def _check(results: list[EquivalenceReport], pipeline: int = 2) -> None:
    report = results[0]
    print(report.table())
    report.raise_if_failed(expect_below_floor=())
    assert report.worst_relative_error <= RTOL, report.worst_relative_error
    stages = {c.name.split(".")[0] for c in report.gradients}
    assert stages == {f"stage{s}" for s in range(pipeline)}, stages
    vision = {c.name.split(".")[0] for c in report.gradients if ".vision." in c.name}
    assert vision == {"stage0"}, f"vision parameters on {vision}: only the first stage holds them"
    unique = len({i.key for t in user.grpo_trajectories(0) for i in t.multimodal})
    assert report.units_with_dedup == unique * STEPS  # only the first stage encodes


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
def test_pp2_dp2_wrapped_step_matches_unwrapped(world4: World, overlap: bool) -> None:
    """PP=2 x DP=2 (1F1B): every gradient on both stages equals the re-encoding reference; only
    the first stage encodes, each unique image once per mini-batch."""
    _check(world4.run(_equivalence, overlap, None))


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.skipif(
    _cuda_devices() < 4,
    reason="needs 4 CUDA GPUs (NCCL): megatron-core 0.16.1's interleaved schedule with "
    "variable-length micro-batches deadlocks (PP4) or aborts (PP2) on gloo p2p, the unwrapped "
    "reference included",
)
@pytest.mark.parametrize("pipeline", [2, 4])
def test_virtual_pipeline_wrapped_step_matches_unwrapped_nccl(pipeline: int) -> None:
    """PP x DP = 4 GPUs with two virtual chunks per stage (interleaved 1F1B), overlap on: the
    vision path in the first stage's first chunk, the same equivalence on every chunk."""
    with World(4, backend="nccl", timeout_s=300) as world:
        _check(world.run(_equivalence, True, 2, pipeline), pipeline=pipeline)


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_devices() < 4, reason="needs CUDA: 4 GPUs for a 4-rank NCCL world")
def test_pp2_dp2_wrapped_step_matches_unwrapped_nccl() -> None:
    """PP=2 x DP=2 on GPUs with NCCL: the same equivalence as on CPU."""
    with World(4, backend="nccl", timeout_s=300) as world:
        _check(world.run(_equivalence, True, None))


def test_pipeline_stages_must_agree_on_micro_batches(world4: World) -> None:
    """Stages with different num_microbatches fail on every rank with the counts named."""
    for message in world4.run(_disagreeing_counts):
        assert "between 3 and 4" in message, message
