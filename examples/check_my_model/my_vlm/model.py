"""The provider and the forward step: a GPTModel fed image features as ``decoder_input``.

The contract (integration/megatron/README.md, "Check your own model"): ``provider()`` takes no
argument and returns this rank's model in megatron's ``DistributedDataParallel``;
``forward_step(data_iterator, model)`` takes one batch and returns ``(output, loss_func)``. The
images come in ``batch["images"]`` (absent under the wrap, whose stand-in vision path ignores
what it is given): per piece of an image the micro-batch consumes, ``(the image's stored input,
first row, end row)``; the model's forward calls its vision path (``model.vision``) once on them,
and ``vision.encode(x)`` maps one image to its feature rows (the wrap's per-image encoder).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

HIDDEN, PATCH, VOCAB, IMAGE_TOKEN, MAX_SEQ = 32, 10, 48, 7, 256


class Vision(torch.nn.Module):
    """Patch embedding (the trunk) and projector; the rows of one image see each other."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(PATCH, 16)
        self.projector = torch.nn.Linear(16, HIDDEN)

    def trunk(self, patches: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.embed(patches))
        return hidden * torch.sigmoid(hidden.mean(0, keepdim=True))

    def encode(self, patches: torch.Tensor) -> torch.Tensor:
        """One image's patches ``[rows, PATCH]`` -> its feature rows ``[rows, HIDDEN]``."""
        return self.projector(self.trunk(patches))

    def forward(self, images: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
        """The features of the consumed pieces, in placeholder order."""
        if not images:
            return self.projector.weight.new_zeros(0, HIDDEN)
        return torch.cat([self.encode(patches)[a:b] for patches, a, b in images])


def build(vision: Callable[[], torch.nn.Module] = Vision) -> Any:
    """The model with ``vision()`` as its vision path, in megatron DDP, hooks set as megatron's
    training loop sets them."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import MegatronModule, TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )

    class MyVLM(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder
            self.vision = vision()
            self.lm = GPTModel(
                config, get_gpt_layer_local_spec(), VOCAB, MAX_SEQ, position_embedding_type="rope"
            )

        def set_input_tensor(self, tensor: torch.Tensor) -> None:
            self.lm.set_input_tensor(tensor)

        def forward(
            self,
            tokens: torch.Tensor,
            position_ids: torch.Tensor,
            attention_mask: torch.Tensor | None,
            labels: torch.Tensor,
            images: list[tuple[torch.Tensor, int, int]] | None = None,
        ) -> torch.Tensor:
            embeddings = self.lm.embedding(input_ids=tokens, position_ids=position_ids)
            features = self.vision(images)  # [image tokens, HIDDEN], in placeholder order
            at_image = (tokens == IMAGE_TOKEN).t().unsqueeze(-1).expand_as(embeddings)
            embeddings = embeddings.masked_scatter(at_image, features.to(embeddings.dtype))
            return self.lm(
                tokens, position_ids, attention_mask, decoder_input=embeddings, labels=labels
            )

    model = MyVLM()
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=True), model
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp


def provider() -> Any:
    """This rank's model (called twice by the check, after seeding: both builds must be equal)."""
    return build()


def _loss(
    loss_mask: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    loss = (output.float() * loss_mask).sum()
    return loss, loss_mask.sum().to(torch.int), {"lm loss": loss.detach()}


def forward_step(
    data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    """megatron's forward step: one batch of the iterator through the model, and its loss."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        batch["labels"],
        images=batch.get("images"),
    )
    return output, functools.partial(_loss, batch["loss_mask"])
