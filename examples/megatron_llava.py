"""megatron-core's own LLaVAModel trained with knitkit: each unique image through the vision path once per mini-batch.

The user keeps their ``LLaVAModel`` (ViT, class-token drop, pixel shuffle, MLP projector,
GPT language model), its checkpoint and Megatron DDP. What changes: samples are expanded at write
time (``llava_sequence``: LLaVA's image-token expansion, labels and loss mask, done once per
sample instead of in the model), the forward step calls ``LLaVADedup.forward(batch)`` instead of
``model(images, input_ids, ...)``, and the schedule runs through ``LLaVADedup.step``.

Run: torchrun --standalone --nproc-per-node 2 examples/megatron_llava.py
(NCCL on 2 GPUs; without CUDA it runs on the CPU with gloo, see ``megatron_common.launch``.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import megatron_common as common
import numpy as np
import torch

from knitkit.integration.megatron import (
    LLaVADedup,
    MegatronLayout,
    batch_for,
    current_device,
    layer_specs,
    llava_sequence,
)
from knitkit.metrics import MetricsObserver
from knitkit.storage import MemoryBackend, MiniBatchPlan, Trajectory, TrajectoryStore
from knitkit.types import UnitKey

HIDDEN, VISION_HIDDEN, VOCAB, MAX_SEQ = 32, 16, 64, 512
IMAGE_TOKEN = -200  # LLaVA's DEFAULT_IMAGE_TOKEN_INDEX
IMG, PATCH = 8, 2  # 16 patches + 1 class token; dropped, pixel-shuffled: 4 rows per tile
IMG_SEQ_LEN = (IMG // PATCH) ** 2 // 4


# ----- the user's LLaVAModel (unchanged by knitkit) -----------------------------------------------
def build_model(overlap_grad_reduce: bool = False, use_te: bool | None = None) -> Any:
    """A tiny ``LLaVAModel`` in Megatron DDP (seeded: the same weights on every call)."""
    from megatron.core.enums import ModelType
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.parallel_state import get_context_parallel_world_size
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules

    specs = layer_specs(use_te)
    shared = common.tiny_config_fields()
    language = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        context_parallel_size=get_context_parallel_world_size(),
        **shared,
    )
    vision = TransformerConfig(
        num_layers=1, hidden_size=VISION_HIDDEN, num_attention_heads=2, **shared
    )
    # InternViT-style (class token, no pre-norm): megatron-core 0.16.1 builds CLIP's ln_pre from
    # torch.nn.LayerNorm without TE, which fails; megatron-LM sets this attribute the same way.
    vision.vision_model_type = "internvit"
    projection = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=HIDDEN, num_attention_heads=4, **shared
    )
    torch.manual_seed(1234)
    model = LLaVAModel(
        language_transformer_config=language,
        language_transformer_layer_spec=specs.language,
        language_vocab_size=VOCAB,
        language_max_sequence_length=MAX_SEQ,
        vision_transformer_config=vision,
        vision_transformer_layer_spec=specs.vision,
        drop_vision_class_token=True,
        vision_projection_config=projection,
        vision_projection_layer_spec=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
        ),
        language_position_embedding_type="rope",
        img_h=IMG,
        img_w=IMG,
        patch_dim=PATCH,
        image_token_index=IMAGE_TOKEN,
        pixel_shuffle=True,
    )
    model.model_type = ModelType.encoder_or_decoder  # as megatron-LM's model provider sets it
    return common.megatron_ddp(model, language, overlap_grad_reduce=overlap_grad_reduce)


def forward_step(
    data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module, llava: LLaVADedup
) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    """The user's forward step; with knitkit it calls ``llava.forward(batch)`` for ``model(...)``."""
    output, loss_mask = llava.forward(next(data_iterator))
    return output, functools.partial(common.loss_func, loss_mask)


# ----- rollout data: GRPO groups whose n trajectories share their prompt's images ----------------
@dataclass(frozen=True, slots=True)
class Sample:
    """A trajectory in LLaVA's own input form (one image token per image)."""

    trajectory_id: str
    input_ids: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    images: tuple[np.ndarray, ...]
    """Per image: its tiles ``[tiles, 3, IMG, IMG]``."""


def grpo_samples(seed: int, prompts: int = 4, n: int = 4) -> list[Sample]:
    """``prompts`` x ``n`` rollouts; each prompt has 1-2 images of 1-2 tiles, shared by its rollouts."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(prompts):
        images = tuple(
            rng.standard_normal((1 + (p + i) % 2, 3, IMG, IMG)).astype(np.float32)
            for i in range(1 + p % 2)
        )
        prompt = [1]  # BOS, then text and an image token per image
        for _ in images:
            prompt += [*rng.integers(4, VOCAB, size=2).tolist(), IMAGE_TOKEN]
        for r in range(n):
            reply = rng.integers(4, VOCAB, size=int(rng.integers(4, 12))).tolist()
            ids = np.array(prompt + reply, dtype=np.int64)
            labels = np.append(ids[1:], 2)  # labels[j] is the target of ids[j]; 2 = EOS
            mask = np.zeros(len(ids), dtype=np.float32)
            mask[len(prompt) - 1 :] = 1.0
            out.append(Sample(f"s{seed}-{p}-{r}", ids, labels, mask, images))
    return out


def write(store: TrajectoryStore, samples: Sequence[Sample]) -> list[str]:
    """Expand each sample as LLaVA would and store it: tokens, labels, loss mask, image units."""
    for s in samples:
        seq = llava_sequence(
            s.input_ids,
            s.labels,
            s.loss_mask,
            img_seq_len=IMG_SEQ_LEN,
            image_token_index=IMAGE_TOKEN,
            tiles=[len(i) for i in s.images],
        )
        sample_id = s.trajectory_id.rsplit("-", 1)[0]
        store.write(
            Trajectory(
                s.trajectory_id, sample_id, seq.fields(), multimodal=seq.multimodal(s.images)
            )
        )
    return [s.trajectory_id for s in samples]


def plan_step(store: TrajectoryStore, ids: list[str], layout: MegatronLayout) -> MiniBatchPlan:
    """knitkit's plan: tokens, labels and loss mask per token (expanded at write time); the
    projector is TP-sharded, so TP peers encode together."""
    return common.plan_step(store, ids, layout, ("tokens", "labels", "loss_mask"), tp_sharded=True)


def knitkit_batches(
    store: TrajectoryStore, plan: MiniBatchPlan, layout: MegatronLayout, use_te: bool
) -> common.Batches:
    """This rank's packed micro-batches through knitkit's prefetch iterator, as Megatron batches."""
    return common.knitkit_batches(store, plan, layout, batch_for(use_te, layout.topology.cp))


# ----- the training loop with knitkit -------------------------------------------------------------
def train(
    steps: int = 3,
    lr: float = 0.1,
    use_te: bool | None = None,
    observe: MetricsObserver | None = None,
) -> list[dict[str, float]]:
    """Train the tiny LLaVA for ``steps`` mini-batches with deduplicated encoding; per-step figures."""
    use_te = layer_specs(use_te).use_te
    layout = MegatronLayout.from_parallel_state()
    model = build_model(use_te=use_te)
    llava = LLaVADedup(model)
    store = TrajectoryStore(MemoryBackend())
    ids = write(store, grpo_samples(seed=0))
    return common.train_loop(
        model,
        llava.step,
        layout,
        plan=lambda: plan_step(store, ids, layout),
        batches=lambda plan: knitkit_batches(store, plan, layout, use_te),
        forward_step=functools.partial(forward_step, llava=llava),
        encode=llava.encode_fn(lambda key: torch.from_numpy(store.read(key)).to(current_device())),
        seq_length=MAX_SEQ,
        steps=steps,
        lr=lr,
        observe=observe,
    )


def unique_images(seed: int = 0, prompts: int = 4) -> set[UnitKey]:
    """The distinct image units of a mini-batch."""
    from knitkit.storage import content_key

    return {content_key("image", i) for s in grpo_samples(seed, prompts) for i in s.images}


if __name__ == "__main__":
    common.launch(train, "image encodings {:.0f} (TP peers encode together)", vision_shim=True)
