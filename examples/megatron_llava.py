"""megatron-core's own LLaVAModel trained with knitkit: each unique image through the vision path once per mini-batch.

The user keeps their ``LLaVAModel`` (ViT, class-token drop, pixel shuffle, MLP projector,
GPT language model), its checkpoint and Megatron DDP. What changes: samples are expanded at write
time (``llava_sequence``: LLaVA's image-token expansion, labels and loss mask, done once per
sample instead of in the model), the forward step calls ``LLaVADedup.forward(batch)`` instead of
``model(images, input_ids, ...)``, and the schedule runs through ``LLaVADedup.step``.

Run (GPUs, NCCL): torchrun --nproc-per-node 2 examples/megatron_llava.py
On CPU the tests run ``train`` in a gloo world with a test-only CUDA shim
(tests/integration/test_megatron_llava.py::test_llava_example_trains_with_dedup).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from knitkit.integration.megatron import (
    LLaVADedup,
    MegatronLayout,
    batch_for,
    layer_specs,
    llava_sequence,
    megatron_batches,
)
from knitkit.microbatch_iter import MicroBatchIterator, PackedMicroBatch
from knitkit.storage import (
    MemoryBackend,
    MiniBatchPlan,
    PlannerConfig,
    Trajectory,
    TrajectoryStore,
    pack,
    plan_minibatch,
)
from knitkit.types import UnitKey

HIDDEN, VISION_HIDDEN, VOCAB, MAX_SEQ = 32, 16, 64, 512
IMAGE_TOKEN = -200  # LLaVA's DEFAULT_IMAGE_TOKEN_INDEX
IMG, PATCH = 8, 2  # 16 patches + 1 class token; dropped, pixel-shuffled: 4 rows per tile
IMG_SEQ_LEN = (IMG // PATCH) ** 2 // 4


# ----- the user's LLaVAModel (unchanged by knitkit) -----------------------------------------------
def build_model(overlap_grad_reduce: bool = False, use_te: bool | None = None) -> Any:
    """A tiny ``LLaVAModel`` in Megatron DDP (seeded: the same weights on every call)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.enums import ModelType
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.parallel_state import (
        get_context_parallel_world_size,
        get_tensor_model_parallel_world_size,
    )
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules

    specs = layer_specs(use_te)
    common: dict[str, Any] = {
        "tensor_model_parallel_size": get_tensor_model_parallel_world_size(),
        "use_cpu_initialization": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    language = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        context_parallel_size=get_context_parallel_world_size(),
        **common,
    )
    vision = TransformerConfig(
        num_layers=1, hidden_size=VISION_HIDDEN, num_attention_heads=2, **common
    )
    # InternViT-style (class token, no pre-norm): megatron-core 0.16.1 builds CLIP's ln_pre from
    # torch.nn.LayerNorm without TE, which fails; megatron-LM sets this attribute the same way.
    vision.vision_model_type = "internvit"
    projection = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=HIDDEN, num_attention_heads=4, **common
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
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallel(
        language, DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce), model
    )
    language.no_sync_func = ddp.no_sync
    language.finalize_model_grads_func = finalize_model_grads
    return ddp


def loss_func(
    loss_mask: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    loss = (output.float() * loss_mask).sum()
    return loss, loss_mask.sum().to(torch.int), {"lm loss": loss.detach()}


def forward_step(
    data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module, llava: LLaVADedup
) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    """The user's forward step; with knitkit it calls ``llava.forward(batch)`` for ``model(...)``."""
    output, loss_mask = llava.forward(next(data_iterator))
    return output, functools.partial(loss_func, loss_mask)


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
    """knitkit's plan of one mini-batch (3 micro-batches per DP rank; TP peers encode together)."""
    config = PlannerConfig(
        token_fields=("tokens", "labels", "loss_mask"), scalar_fields=(), min_micro_batches=3
    )
    encoder = layout.encoder_topology(tp_sharded=True)
    return plan_minibatch(store.metas(ids), layout.topology, config, encoders=[encoder])


def knitkit_batches(
    store: TrajectoryStore, plan: MiniBatchPlan, layout: MegatronLayout, use_te: bool
) -> tuple[MicroBatchIterator, Iterator[Mapping[str, object]]]:
    """This rank's packed micro-batches through knitkit's prefetch iterator, as Megatron batches."""
    dp, cp, _ = layout.coord
    consumer = plan.consumer(dp, cp)
    schema = store.schema(consumer.micro_batches[0].sequences[0].trajectory_id)
    packed = (PackedMicroBatch(*pack(mb, schema, store.read_into)) for mb in consumer.micro_batches)
    iterator = MicroBatchIterator(packed)
    return iterator, megatron_batches(iterator, batch_for(use_te, layout.topology.cp))


# ----- the training loop with knitkit -------------------------------------------------------------
def train(steps: int = 3, lr: float = 0.1, use_te: bool | None = None) -> list[dict[str, float]]:
    """Train the tiny LLaVA for ``steps`` mini-batches with deduplicated encoding; per-step figures."""
    use_te = layer_specs(use_te).use_te
    layout = MegatronLayout.from_parallel_state()
    model = build_model(use_te=use_te)
    llava = LLaVADedup(model)
    store = TrajectoryStore(MemoryBackend())
    ids = write(store, grpo_samples(seed=0))
    encode = llava.encode_fn(lambda key: torch.from_numpy(store.read(key)).to(_device()))
    history = []
    for _ in range(steps):
        plan = plan_step(store, ids, layout)
        model.zero_grad_buffer()
        iterator, data = knitkit_batches(store, plan, layout, use_te)
        with iterator:
            losses: list[Any] = llava.step.run(
                forward_step_func=functools.partial(forward_step, llava=llava),
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
        units = torch.tensor(float(llava.step.last_encoded_units), device=_device())
        dist.all_reduce(units)
        history.append({"loss": float(loss), "encoded_units": float(units)})
    return history


def unique_images(seed: int = 0, prompts: int = 4) -> set[UnitKey]:
    """The distinct image units of a mini-batch."""
    from knitkit.storage import content_key

    return {content_key("image", i) for s in grpo_samples(seed, prompts) for i in s.images}


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
