"""Wrap an existing Megatron VLM train step with knitkit: each unique image encoded once per mini-batch.

The user's code is a ``GPTModel`` fed through ``decoder_input`` plus a vision encoder and projector,
a forward-step function and a loss, run under ``get_forward_backward_func()`` with Megatron DDP.
The wrap keeps all of it and adds: knitkit's planner (topology from ``parallel_state``), the THD
packer and prefetch iterator as the data iterator, and ``DedupVLMStep`` around the schedule.

Run: torchrun --standalone --nproc-per-node 2 examples/megatron_wrap.py
(NCCL on 2 GPUs; without CUDA it runs on the CPU with gloo, see ``megatron_common.launch``.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import megatron_common as common
import numpy as np
import torch

from knitkit.integration.megatron import (
    DedupVLMStep,
    MegatronLayout,
    current_device,
    layer_specs,
    megatron_batch,
)
from knitkit.metrics import MetricsObserver
from knitkit.storage import (
    MiniBatchPlan,
    MultimodalInput,
    Trajectory,
    TrajectoryStore,
)
from knitkit.types import UnitKey

HIDDEN, VISION_HIDDEN, VOCAB, PATCH_DIM, IMAGE_TOKEN, MAX_SEQ = 32, 24, 64, 12, 3, 512


# ----- the user's existing Megatron VLM (unchanged by the wrap) -----------------------------------
class VisionPath(torch.nn.Module):
    """Vision encoder + projector: an image's patches -> one feature row per placeholder token."""

    def __init__(self, projector: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(PATCH_DIM, VISION_HIDDEN)
        self.projector = projector or torch.nn.Linear(VISION_HIDDEN, HIDDEN)

    def encode(self, patches: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.encoder(patches))
        return self.projector(hidden + hidden.mean(0, keepdim=True))  # patches see each other

    def forward(self, images: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
        """``images``: per consumed piece, (the image's patches, first row, end row)."""
        return torch.cat([self.encode(patches)[a:b] for patches, a, b in images])


class VisionTransformer(torch.nn.Module):
    """A TP-sharded vision path as in LLaVA: patch embedding, megatron transformer layers (q/k
    layernorm; sequence parallel when the config says so) and megatron's ``MultimodalProjector``.

    Under sequence parallelism the patch sequence is scattered over TP before the layers and
    gathered after them, so layernorms and row-parallel biases see a slice of the sequence and
    carry megatron's ``sequence_parallel`` tag: ``finalize_model_grads`` sums them over TP.
    """

    def __init__(self, config: Any, projector_config: Any, layer_spec: Any) -> None:
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.transformer_block import TransformerBlock

        super().__init__()
        self.config = config
        self.patch_embed = torch.nn.Linear(PATCH_DIM, VISION_HIDDEN)
        self.encoder = TransformerBlock(config, layer_spec, post_layer_norm=True)
        self.projector = MultimodalProjector(
            projector_config,
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            "mlp",
            VISION_HIDDEN,
        )

    def encode(self, patches: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            gather_from_sequence_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        rows = len(patches)
        hidden = self.patch_embed(patches)
        if self.config.sequence_parallel:  # the scatter needs a multiple of TP rows
            pad = -rows % self.config.tensor_model_parallel_size
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
        # Patches see each other, never the padding (True = masked).
        padding = torch.arange(len(hidden), device=hidden.device) >= rows
        mask = padding[None, None, None, :].expand(1, 1, len(hidden), len(hidden))
        hidden = hidden[:, None]
        if self.config.sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden)
        hidden = self.encoder(hidden, attention_mask=mask)
        if self.config.sequence_parallel:  # every TP rank then uses all rows alike
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return self.projector(hidden[:rows, 0])

    def forward(self, images: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
        return torch.cat([self.encode(patches)[a:b] for patches, a, b in images])


def build_model(
    overlap_grad_reduce: bool,
    tp_sharded_projector: bool = False,
    *,
    vision_transformer: bool = False,
    sequence_parallel: bool = False,
    block_spec: Callable[[int], Any] | None = None,
    distributed_optimizer: bool = False,
    overlap_param_gather: bool = False,
) -> Any:
    """GPTModel + vision path in one MegatronModule, wrapped in Megatron DDP (seeded: same on every call).

    ``tp_sharded_projector`` uses megatron's ``MultimodalProjector`` (column- then row-parallel,
    as in LLaVA) instead of a replicated linear projector; ``vision_transformer`` uses the
    TP-sharded ``VisionTransformer`` (q/k layernorm in both models). ``sequence_parallel`` turns
    on megatron's sequence parallelism (the forward injects image features, then scatters).
    ``block_spec(num_layers)`` gives the transformer layers' spec (default: megatron's local
    spec; pass norms that support sequence parallelism, e.g. TE's or apex's, with it).
    ``distributed_optimizer`` shards the gradient buffers for megatron's ``DistributedOptimizer``
    (``overlap_param_gather``: its parameter all-gather overlaps the next forward).
    """
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer import MegatronModule, TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules

    shared: dict[str, Any] = {
        **common.tiny_config_fields(),
        "sequence_parallel": sequence_parallel,
        "qk_layernorm": vision_transformer,
    }
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, **shared)
    spec = block_spec or (lambda layers: get_gpt_layer_local_spec(qk_layernorm=vision_transformer))

    class TinyVLM(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder
            projector_config = dataclasses.replace(config, sequence_parallel=False)
            self.vision: torch.nn.Module
            if vision_transformer:
                vision_config = TransformerConfig(
                    num_layers=1, hidden_size=VISION_HIDDEN, num_attention_heads=4, **shared
                )
                self.vision = VisionTransformer(vision_config, projector_config, spec(1))
            else:
                projector = None
                if tp_sharded_projector:
                    projector = MultimodalProjector(
                        projector_config,
                        MLPSubmodules(
                            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                        ),
                        "mlp",
                        VISION_HIDDEN,
                    )
                self.vision = VisionPath(projector)
            self.language_model = GPTModel(
                config,
                spec(config.num_layers),
                VOCAB,
                MAX_SEQ,
                position_embedding_type="rope",
                scatter_embedding_sequence_parallel=False,  # inject features first (forward)
            )

        def set_input_tensor(self, tensor: torch.Tensor) -> None:
            self.language_model.set_input_tensor(tensor)

        def forward(
            self,
            tokens: torch.Tensor,
            position_ids: torch.Tensor,
            attention_mask: torch.Tensor | None,
            labels: torch.Tensor,
            images: list[tuple[torch.Tensor, int, int]] | None = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            # The whole sequence's embeddings, image features injected, THEN the sequence-parallel
            # scatter (as LLaVA, verl and slime do): injecting after a scatter would need every
            # TP rank to find its own slice of the placeholders.
            embeddings = self.language_model.embedding(input_ids=tokens, position_ids=position_ids)
            features = self.vision(images)  # [image tokens, hidden], in placeholder order
            at_image = (tokens == IMAGE_TOKEN).t().unsqueeze(-1).expand_as(embeddings)
            embeddings = embeddings.masked_scatter(at_image, features.to(embeddings.dtype))
            if config.sequence_parallel:
                embeddings = scatter_to_sequence_parallel_region(embeddings)
            return self.language_model(
                tokens,
                position_ids,
                attention_mask,
                decoder_input=embeddings,
                labels=labels,
                packed_seq_params=packed_seq_params,
            )

    torch.manual_seed(1234)
    return common.megatron_ddp(
        TinyVLM(),
        config,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=distributed_optimizer,
        overlap_param_gather=overlap_param_gather,
    )


def forward_step(
    data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    batch = next(data_iterator)
    thd = "attention_mask" not in batch  # THD attention (TE) takes the packed sequences instead
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        batch["labels"],
        images=batch.get("images"),
        packed_seq_params=batch["packed_seq_params"] if thd else None,
    )
    return output, functools.partial(common.loss_func, batch["loss_mask"])


# ----- rollout data: GRPO groups whose n trajectories share their prompt's images ----------------
def grpo_trajectories(seed: int, samples: int = 4, n: int = 4) -> list[Trajectory]:
    """``samples`` prompts x ``n`` rollouts; each prompt has 1-2 images of 4-6 patches."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(samples):
        images, at = [], 2
        for _ in range(1 + s % 2):
            patches = int(rng.integers(4, 7))
            pixels = rng.standard_normal((patches, PATCH_DIM)).astype(np.float32)
            images.append(MultimodalInput("image", pixels, at, patches))
            at += patches + 1
        for r in range(n):
            length = at + int(rng.integers(8, 24))
            tokens = rng.integers(4, VOCAB, size=length).astype(np.int64)
            for image in images:
                tokens[image.token_start : image.token_start + image.num_tokens] = IMAGE_TOKEN
            out.append(
                Trajectory(
                    f"s{seed}-{s}-{r}", f"s{seed}-{s}", {"tokens": tokens}, multimodal=tuple(images)
                )
            )
    return out


def plan_step(
    store: TrajectoryStore, ids: list[str], layout: MegatronLayout, tp_sharded: bool = False
) -> MiniBatchPlan:
    """knitkit's plan of one mini-batch: the tokens per token, the images as units."""
    return common.plan_step(store, ids, layout, ("tokens",), tp_sharded=tp_sharded)


def knitkit_batches(
    store: TrajectoryStore, plan: MiniBatchPlan, layout: MegatronLayout, thd: bool = False
) -> common.Batches:
    """This rank's packed micro-batches through knitkit's prefetch iterator, as Megatron batches.

    ``thd=True`` hands the model ``packed_seq_params`` (THD attention, TE's layer spec);
    otherwise a block-causal attention mask for megatron's local attention (CP=1).
    """
    to_batch = functools.partial(megatron_batch, cp_size=layout.topology.cp, attention_mask=not thd)
    return common.knitkit_batches(store, plan, layout, to_batch)


# ----- the wrap -----------------------------------------------------------------------------------
def train(
    steps: int = 3,
    overlap_grad_reduce: bool = False,
    lr: float = 0.1,
    use_te: bool | None = None,
    observe: MetricsObserver | None = None,
) -> list[dict[str, float]]:
    """Train the tiny VLM for ``steps`` mini-batches with deduplicated encoding; per-step figures.

    With Transformer Engine (installed, or ``use_te=True``) the model gets TE's layer spec and
    THD batches (``packed_seq_params``); without it megatron's local spec and a block-causal mask.
    """
    specs = layer_specs(use_te)
    layout = MegatronLayout.from_parallel_state()
    model = build_model(overlap_grad_reduce, block_spec=lambda layers: specs.language)
    vision = model.module.vision
    store, ids = common.memory_store(grpo_trajectories(seed=0))

    # The user's vision path, run by knitkit once per unique image of the mini-batch.
    def encode(keys: Sequence[UnitKey]) -> torch.Tensor:
        pixels = [torch.from_numpy(store.read(k)).to(current_device()) for k in keys]
        return torch.cat([vision.encode(p) for p in pixels])

    return common.train_loop(
        model,
        DedupVLMStep(model, vision="vision"),
        layout,
        plan=lambda: plan_step(store, ids, layout),
        batches=lambda plan: knitkit_batches(store, plan, layout, thd=specs.use_te),
        forward_step=forward_step,
        encode=encode,
        seq_length=MAX_SEQ,
        steps=steps,
        lr=lr,
        observe=observe,
    )


if __name__ == "__main__":
    common.launch(train, "unique images encoded {:.0f}")
