"""A Qwen-VL style Megatron VLM (mRoPE) trained with knitkit: 3-D positions stored per token, images encoded once.

The user's model is built from megatron-core pieces: a vision encoder taking ``pixel_values`` and
``grid_thw`` per image (patch embedding, grid positions, a megatron ``TransformerBlock``, 2x2
patch merger, TP-sharded ``MultimodalProjector``) and a ``GPTModel`` with
``position_embedding_type="mrope"``. With knitkit: positions come from ``mrope_positions`` at write
time (as Qwen2.5-VL's ``get_rope_index``) and travel as the per-token field
``mrope_position_ids``; each image unit stores its ``pixel_values`` shaped ``[t, h, w, dim]`` so its
``grid_thw`` travels with it; the schedule runs through ``DedupVLMStep``.

Run (GPUs, NCCL): torchrun --nproc-per-node 2 examples/megatron_mrope.py
On CPU the tests run ``train`` in a gloo world with a test-only CUDA shim
(tests/integration/test_megatron_mrope.py::test_mrope_example_trains_with_dedup).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from knitkit.integration.megatron import (
    MROPE_FIELD,
    DedupVLMStep,
    MegatronLayout,
    disable_rotary_cp_slicing,
    layer_specs,
    megatron_batches,
    mrope_batch,
    mrope_positions,
)
from knitkit.microbatch_iter import MicroBatchIterator, PackedMicroBatch
from knitkit.storage import (
    MemoryBackend,
    MiniBatchPlan,
    MultimodalInput,
    PlannerConfig,
    Trajectory,
    TrajectoryStore,
    pack,
    plan_minibatch,
)
from knitkit.types import UnitKey

HIDDEN, VISION_HIDDEN, VOCAB, PATCH_DIM, MAX_SEQ = 32, 16, 64, 12, 512
IMAGE_TOKEN, MERGE, MAX_GRID = 3, 2, 8
MROPE_SECTION = [2, 1, 1]  # temporal, height, width halves of the rotary dimension (kv_channels 8)


# ----- the user's Qwen-VL style model (unchanged by knitkit) --------------------------------------
def image_unit(pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> np.ndarray:
    """One image's stored unit: Qwen's ``pixel_values`` ``[t*h*w, dim]`` shaped ``[t, h, w, dim]``."""
    return pixel_values.reshape(*grid_thw, pixel_values.shape[-1])


def build_model(overlap_grad_reduce: bool = False, use_te: bool | None = None) -> Any:
    """Vision encoder + mRoPE ``GPTModel`` in one MegatronModule, in Megatron DDP (seeded)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.parallel_state import (
        get_context_parallel_world_size,
        get_tensor_model_parallel_world_size,
    )
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import MegatronModule, TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_block import TransformerBlock

    specs = layer_specs(use_te)
    common: dict[str, Any] = {
        "tensor_model_parallel_size": get_tensor_model_parallel_world_size(),
        "use_cpu_initialization": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        mrope_section=MROPE_SECTION,
        context_parallel_size=get_context_parallel_world_size(),
        **common,
    )
    vision_config = TransformerConfig(
        num_layers=1, hidden_size=VISION_HIDDEN, num_attention_heads=2, **common
    )

    class VisionEncoder(MegatronModule):
        """pixel_values + grid_thw of one image -> one row per merged 2x2 patch window."""

        def __init__(self) -> None:
            super().__init__(vision_config)
            self.patch_embed = torch.nn.Linear(PATCH_DIM, VISION_HIDDEN)
            self.row_embed = torch.nn.Embedding(MAX_GRID, VISION_HIDDEN)
            self.col_embed = torch.nn.Embedding(MAX_GRID, VISION_HIDDEN)
            self.blocks = TransformerBlock(vision_config, specs.vision, post_process=False)
            self.merger = MultimodalProjector(
                config,
                MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                "mlp",
                VISION_HIDDEN * MERGE * MERGE,
            )

        def encode(self, unit: torch.Tensor) -> torch.Tensor:
            """``unit``: ``[t, h, w, dim]`` patches in Qwen's merge-window order."""
            t, h, w, _ = unit.shape
            rows = torch.arange(h, device=unit.device)[:, None].expand(h, w)
            cols = torch.arange(w, device=unit.device)[None, :].expand(h, w)
            order = (h // MERGE, MERGE, w // MERGE, MERGE)  # Qwen's window-major patch order
            rows = rows.reshape(order).permute(0, 2, 1, 3).reshape(-1).repeat(t)
            cols = cols.reshape(order).permute(0, 2, 1, 3).reshape(-1).repeat(t)
            x = self.patch_embed(unit.reshape(-1, unit.shape[-1]))
            x = x + self.row_embed(rows) + self.col_embed(cols)
            full = torch.zeros(1, 1, len(x), len(x), dtype=torch.bool, device=x.device)
            x = self.blocks(x[:, None], attention_mask=full)[:, 0]  # full attention in the image
            return self.merger(x.reshape(-1, MERGE * MERGE * VISION_HIDDEN))

        def forward(self, images: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
            """``images``: per consumed piece, (the image's unit, first row, end row)."""
            return torch.cat([self.encode(unit)[a:b] for unit, a, b in images])

    class QwenVLStyle(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder
            self.vision = VisionEncoder()
            self.language_model = GPTModel(
                config, specs.language, VOCAB, MAX_SEQ, position_embedding_type="mrope"
            )
            if config.context_parallel_size > 1:  # knitkit places the positions per CP rank
                disable_rotary_cp_slicing(self.language_model)

        def set_input_tensor(self, tensor: torch.Tensor) -> None:
            self.language_model.set_input_tensor(tensor)

        def forward(
            self,
            tokens: torch.Tensor,
            position_ids: torch.Tensor,
            attention_mask: torch.Tensor | None,
            labels: torch.Tensor,
            images: list[tuple[torch.Tensor, int, int]] | None = None,
            packed_seq_params: object = None,
        ) -> torch.Tensor:
            embeddings = self.language_model.embedding(input_ids=tokens, position_ids=None)
            features = self.vision(images)  # [image tokens, hidden], in placeholder order
            at_image = (tokens == IMAGE_TOKEN).t().unsqueeze(-1).expand_as(embeddings)
            embeddings = embeddings.masked_scatter(at_image, features.to(embeddings.dtype))
            return self.language_model(
                tokens,
                position_ids,  # [3, 1, T]: mRoPE
                attention_mask,
                decoder_input=embeddings,
                labels=labels,
                packed_seq_params=packed_seq_params,
            )

    torch.manual_seed(1234)
    model = QwenVLStyle()
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce), model
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp


def loss_func(
    loss_mask: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    loss = (output.float() * loss_mask).sum()
    return loss, loss_mask.sum().to(torch.int), {"lm loss": loss.detach()}


def forward_step(
    data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        batch["labels"],
        images=batch.get("images"),
        packed_seq_params=batch.get("packed_seq_params"),
    )
    return output, functools.partial(loss_func, batch["loss_mask"])


# ----- rollout data: GRPO groups sharing their prompt's images, processor-expanded ----------------
def grpo_trajectories(seed: int, samples: int = 4, n: int = 4) -> list[Trajectory]:
    """``samples`` prompts x ``n`` rollouts; 1-2 images per prompt, grids of 2-4 x 2-4 patches."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(samples):
        prompt: list[int] = [1]
        grids: list[tuple[int, int, int]] = []
        units = []
        for _ in range(1 + s % 2):
            grid = (1, 2 * int(rng.integers(1, 3)), 2 * int(rng.integers(1, 3)))
            pixels = rng.standard_normal((int(np.prod(grid)), PATCH_DIM)).astype(np.float32)
            prompt += rng.integers(4, VOCAB, size=2).tolist()
            units.append((image_unit(pixels, grid), len(prompt), int(np.prod(grid)) // MERGE**2))
            prompt += [IMAGE_TOKEN] * units[-1][2]
            grids.append(grid)
        for r in range(n):
            reply = rng.integers(4, VOCAB, size=int(rng.integers(6, 16))).tolist()
            tokens = np.array(prompt + reply, dtype=np.int64)
            positions = mrope_positions(
                tokens, grids, image_token_id=IMAGE_TOKEN, spatial_merge_size=MERGE
            )
            labels = np.append(tokens[1:], 0)
            loss_mask = np.zeros(len(tokens), dtype=np.float32)
            loss_mask[len(prompt) - 1 : -1] = 1.0  # position t predicts token t+1
            fields = {
                "tokens": tokens,
                "labels": labels,
                "loss_mask": loss_mask,
                MROPE_FIELD: np.ascontiguousarray(positions.T),
            }
            multimodal = tuple(
                MultimodalInput("image", unit, at, rows, cost=float(unit[..., 0].size))
                for unit, at, rows in units
            )
            out.append(
                Trajectory(f"s{seed}-{s}-{r}", f"s{seed}-{s}", fields, multimodal=multimodal)
            )
    return out


def plan_step(store: TrajectoryStore, ids: list[str], layout: MegatronLayout) -> MiniBatchPlan:
    """knitkit's plan: tokens, labels, loss mask and 3-D positions per token; TP peers encode together."""
    config = PlannerConfig(
        token_fields=("tokens", "labels", "loss_mask", MROPE_FIELD),
        scalar_fields=(),
        min_micro_batches=3,
    )
    encoder = layout.encoder_topology(tp_sharded=True)
    return plan_minibatch(store.metas(ids), layout.topology, config, encoders=[encoder])


def knitkit_batches(
    store: TrajectoryStore, plan: MiniBatchPlan, layout: MegatronLayout, use_te: bool
) -> tuple[MicroBatchIterator, Iterator[Mapping[str, object]]]:
    """This rank's packed micro-batches through knitkit's prefetch iterator, mRoPE positions included."""
    dp, cp, _ = layout.coord
    consumer = plan.consumer(dp, cp)
    schema = store.schema(consumer.micro_batches[0].sequences[0].trajectory_id)
    packed = (PackedMicroBatch(*pack(mb, schema, store.read_into)) for mb in consumer.micro_batches)
    iterator = MicroBatchIterator(packed)
    to_batch = functools.partial(mrope_batch, use_te=use_te, cp_size=layout.topology.cp, cp_rank=cp)
    return iterator, megatron_batches(iterator, to_batch)


# ----- the training loop with knitkit -------------------------------------------------------------
def train(steps: int = 3, lr: float = 0.1, use_te: bool | None = None) -> list[dict[str, float]]:
    """Train for ``steps`` mini-batches with deduplicated encoding; per-step figures."""
    use_te = layer_specs(use_te).use_te
    layout = MegatronLayout.from_parallel_state()
    model = build_model(use_te=use_te)
    vision = model.module.vision
    store = TrajectoryStore(MemoryBackend())
    trajectories = grpo_trajectories(seed=0)
    for trajectory in trajectories:
        store.write(trajectory)
    ids = [t.trajectory_id for t in trajectories]
    step = DedupVLMStep(model, vision="vision", tp_sharded_vision=True)

    def encode(keys: Sequence[UnitKey]) -> torch.Tensor:
        return torch.cat(
            [vision.encode(torch.from_numpy(store.read(k)).to(_device())) for k in keys]
        )

    history = []
    for _ in range(steps):
        plan = plan_step(store, ids, layout)
        model.zero_grad_buffer()
        iterator, data = knitkit_batches(store, plan, layout, use_te)
        with iterator:
            losses: list[Any] = step.run(
                forward_step_func=forward_step,
                data_iterator=data,
                route=layout.route(plan),
                encode_fn=encode,
                num_microbatches=plan.num_micro_batches,
                seq_length=MAX_SEQ,
                micro_batch_size=1,
            )
        for param in model.parameters():  # stand-in for the user's Megatron optimizer
            param.data.add_(param.main_grad, alpha=-lr)
        loss = torch.stack([out["lm loss"] for out in losses]).sum()
        dist.all_reduce(loss)
        units = torch.tensor(float(step.last_encoded_units), device=_device())
        dist.all_reduce(units)
        history.append({"loss": float(loss), "encoded_units": float(units)})
    return history


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def main() -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    model_parallel_cuda_manual_seed(1234)
    for i, figures in enumerate(train()):
        if dist.get_rank() == 0:
            print(
                f"step {i}: loss {figures['loss']:.4f}, "
                f"image encodings {figures['encoded_units']:.0f} (TP peers encode together)"
            )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
