"""A Qwen-VL style Megatron VLM (mRoPE) trained with knitkit: 3-D positions stored per token, images encoded once.

The user's model is built from megatron-core pieces: a vision encoder taking ``pixel_values`` and
``grid_thw`` per image (patch embedding, grid positions, a megatron ``TransformerBlock``, 2x2
patch merger, TP-sharded ``MultimodalProjector``) and a ``GPTModel`` with
``position_embedding_type="mrope"``. With knitkit: positions come from ``mrope_positions`` at write
time (as Qwen2.5-VL's ``get_rope_index``) and travel as the per-token field
``mrope_position_ids``; each image unit stores its ``pixel_values`` shaped ``[t, h, w, dim]`` so its
``grid_thw`` travels with it; the schedule runs through ``DedupVLMStep``.

Run: torchrun --standalone --nproc-per-node 2 examples/megatron_mrope.py
(NCCL on 2 GPUs; without CUDA it runs on the CPU with gloo, see ``megatron_common.launch``.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import megatron_common as common
import numpy as np
import torch

from knitkit.integration.megatron import (
    MROPE_FIELD,
    DedupVLMStep,
    MegatronLayout,
    current_device,
    disable_rotary_cp_slicing,
    layer_specs,
    mrope_batch,
    mrope_positions,
)
from knitkit.metrics import MetricsObserver
from knitkit.storage import (
    MiniBatchPlan,
    MultimodalInput,
    Trajectory,
    TrajectoryStore,
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
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.parallel_state import get_context_parallel_world_size
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import MegatronModule, TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_block import TransformerBlock

    specs = layer_specs(use_te)
    shared = common.tiny_config_fields()
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        mrope_section=MROPE_SECTION,
        context_parallel_size=get_context_parallel_world_size(),
        **shared,
    )
    vision_config = TransformerConfig(
        num_layers=1, hidden_size=VISION_HIDDEN, num_attention_heads=2, **shared
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
    return common.megatron_ddp(QwenVLStyle(), config, overlap_grad_reduce=overlap_grad_reduce)


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
    return output, functools.partial(common.loss_func, batch["loss_mask"])


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
    fields = ("tokens", "labels", "loss_mask", MROPE_FIELD)
    return common.plan_step(store, ids, layout, fields, tp_sharded=True)


def knitkit_batches(
    store: TrajectoryStore, plan: MiniBatchPlan, layout: MegatronLayout, use_te: bool
) -> common.Batches:
    """This rank's packed micro-batches through knitkit's prefetch iterator, mRoPE positions included."""
    cp = layout.coord[1]
    to_batch = functools.partial(mrope_batch, use_te=use_te, cp_size=layout.topology.cp, cp_rank=cp)
    return common.knitkit_batches(store, plan, layout, to_batch)


# ----- the training loop with knitkit -------------------------------------------------------------
def train(
    steps: int = 3,
    lr: float = 0.1,
    use_te: bool | None = None,
    observe: MetricsObserver | None = None,
) -> list[dict[str, float]]:
    """Train for ``steps`` mini-batches with deduplicated encoding; per-step figures."""
    use_te = layer_specs(use_te).use_te
    layout = MegatronLayout.from_parallel_state()
    model = build_model(use_te=use_te)
    vision = model.module.vision
    store, ids = common.memory_store(grpo_trajectories(seed=0))

    def encode(keys: Sequence[UnitKey]) -> torch.Tensor:
        units = [torch.from_numpy(store.read(k)).to(current_device()) for k in keys]
        return torch.cat([vision.encode(unit) for unit in units])

    return common.train_loop(
        model,
        DedupVLMStep(model, vision="vision", tp_sharded_vision=True),
        layout,
        plan=lambda: plan_step(store, ids, layout),
        batches=lambda plan: knitkit_batches(store, plan, layout, use_te),
        forward_step=forward_step,
        encode=encode,
        seq_length=MAX_SEQ,
        steps=steps,
        lr=lr,
        observe=observe,
    )


if __name__ == "__main__":
    common.launch(train, "image encodings {:.0f} (TP peers encode together)")
