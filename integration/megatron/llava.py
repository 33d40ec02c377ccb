"""megatron-core's ``LLaVAModel`` under knitkit: its vision path as the encoder, its language model fed packed rows.

``LLaVAModel.forward`` clashes with knitkit's packing twice, and the adapter resolves both without
touching the model or its checkpoint:

- LLaVA expands each image token into ``img_seq_len`` embeddings per tile inside the model, and
  rewrites labels and loss mask to match. knitkit plans, CP-splits and packs per token, so the
  expansion moves to write time: ``llava_sequence`` turns a LLaVA sample into the expanded
  per-token fields (tokens, labels, loss mask: exactly what ``_preprocess_data`` builds) plus
  the images' placeholder spans.
- LLaVA splits context parallelism itself from the full combined sequence. knitkit hands each CP
  rank only its own THD pieces, so ``LLaVADedup.forward`` builds the combined embedding of the
  local tokens and calls the language model directly with ``PackedSeqParams``, skipping LLaVA's
  own split.

The vision path (``vision_model``, class-token drop, pixel shuffle, ``vision_projection``) runs
as knitkit's encoder function, once per unique image of the mini-batch (``DedupVLMStep``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from knitkit.encoder_dedup import EncodeFn
from knitkit.integration.megatron.step import DedupVLMStep
from knitkit.storage import MultimodalInput
from knitkit.types import UnitKey

if TYPE_CHECKING:
    from megatron.core.models.multimodal.llava_model import LLaVAModel

IGNORE_INDEX = -100
"""LLaVA's label at positions that predict nothing (image rows, the row before an image)."""


@dataclass(frozen=True, slots=True)
class LLaVASequence:
    """One LLaVA sample in knitkit's per-token form (image tokens expanded to their rows)."""

    tokens: np.ndarray
    """int64 ``[S]``: text ids, ``image_token_index`` at every image row."""
    labels: np.ndarray
    """int64 ``[S]``: LLaVA's combined labels (``IGNORE_INDEX`` where nothing is predicted)."""
    loss_mask: np.ndarray
    """float32 ``[S]``: LLaVA's combined loss mask (0 on image rows and on the row before one)."""
    image_spans: tuple[tuple[int, int], ...]
    """Per image, in order: (first row, rows = tiles * img_seq_len)."""

    def fields(self) -> dict[str, np.ndarray]:
        """The per-token fields to store (plan them with ``token_fields=("tokens", "labels", "loss_mask")``)."""
        return {"tokens": self.tokens, "labels": self.labels, "loss_mask": self.loss_mask}

    def multimodal(self, images: Sequence[np.ndarray]) -> tuple[MultimodalInput, ...]:
        """One unit per image (its tiles ``[tiles, C, H, W]``) at its placeholder span."""
        if len(images) != len(self.image_spans):
            raise ValueError(
                f"{len(images)} images for {len(self.image_spans)} image tokens; pass one "
                "[tiles, C, H, W] array per image token, in order"
            )
        return tuple(
            MultimodalInput("image", data, start, rows, cost=float(rows))
            for data, (start, rows) in zip(images, self.image_spans, strict=True)
        )


def llava_sequence(
    input_ids: np.ndarray,
    labels: np.ndarray,
    loss_mask: np.ndarray,
    *,
    img_seq_len: int,
    image_token_index: int,
    tiles: Sequence[int] | None = None,
) -> LLaVASequence:
    """Expand one LLaVA sample at write time, as ``LLaVAModel._preprocess_data`` does in the model.

    ``input_ids``, ``labels``, ``loss_mask`` are LLaVA's text-length inputs (one
    ``image_token_index`` per image, ``labels[j]`` the target of ``input_ids[j]``); ``tiles``
    gives each image's tile count (default 1). The combined row of text token ``j`` is ``j``
    plus the rows its preceding images add; the row before a text token takes that token's
    predecessor's label; image rows and the text row just before an image are loss-masked.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    is_image = ids == image_token_index
    count = int(is_image.sum())
    per_image = np.ones(count, dtype=np.int64) if tiles is None else np.asarray(tiles, np.int64)
    if len(per_image) != count:
        raise ValueError(
            f"tiles has {len(per_image)} entries for {count} image tokens; pass one tile count "
            "per image token, in order"
        )
    widths = np.ones(len(ids), dtype=np.int64)
    widths[is_image] = per_image * img_seq_len
    last_row = np.cumsum(widths) - 1  # combined row of each text token / last row of each image
    total = int(last_row[-1]) + 1
    text = np.flatnonzero(~is_image)
    text_rows = last_row[text]

    tokens = np.full(total, image_token_index, dtype=np.int64)
    tokens[text_rows] = ids[text]
    out_labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
    shifted = text > 0
    out_labels[text_rows[shifted] - 1] = np.asarray(labels, np.int64)[text[shifted] - 1]
    out_labels[total - 1] = int(labels[-1])
    mask = np.zeros(total, dtype=np.float32)
    mask[text_rows] = np.asarray(loss_mask, np.float32)[text]
    images = np.flatnonzero(is_image)
    before = images[images > 0] - 1
    mask[last_row[before]] = 0.0
    spans = tuple((int(last_row[i] - widths[i] + 1), int(widths[i])) for i in images)
    return LLaVASequence(tokens, out_labels, mask, spans)


@dataclass(slots=True)
class LLaVADedup:
    """Runs a user's (DDP-wrapped) ``LLaVAModel`` with each unique image encoded once per mini-batch.

    ``step`` is the ``DedupVLMStep`` to run the schedule with: LLaVA's vision path is TP-sharded
    (its projector, and the ViT at TP>1), so TP peers encode together; during ``run`` the
    ``vision_projection`` attribute serves the cached, projected rows (``vision_model`` stays:
    LLaVA's ``set_input_tensor`` reaches into it). The forward step calls
    ``forward(batch)`` instead of ``model(images, input_ids, ...)``; its output and loss mask
    are what ``LLaVAModel.forward`` returns.
    """

    model: torch.nn.Module
    """The model chunk handed to the schedule (Megatron DDP around an ``LLaVAModel``)."""
    step: DedupVLMStep = field(init=False)
    _vision_model: torch.nn.Module = field(init=False)
    _projection: torch.nn.Module = field(init=False)

    def __post_init__(self) -> None:
        llava = self.llava
        if getattr(llava, "_tile_tags", None) is not None:
            raise ValueError(
                "LLaVAModel(tile_tags=...) prepends language-model embeddings to each image; "
                "build it without tile_tags for knitkit's dedup"
            )
        position = getattr(llava.language_model, "position_embedding_type", "")
        if position == "learned_absolute":
            raise ValueError(
                "LLaVA's learned_absolute positions count an image as one position, knitkit's "
                "packed rows count each image row; use language_position_embedding_type='rope'"
            )
        if not (llava.pre_process and llava.post_process and llava.add_encoder):
            raise ValueError("LLaVADedup runs a whole LLaVAModel on one stage (PP=1)")
        self._vision_model = llava.vision_model
        self._projection = llava.vision_projection
        self.step = DedupVLMStep(
            self.model,
            vision="vision_projection",
            tp_sharded_vision=True,
            vision_extra=("vision_model",),
        )

    @property
    def llava(self) -> LLaVAModel:
        from megatron.core.utils import unwrap_model

        return unwrap_model(self.model)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """LLaVA's vision path on ``[tiles, C, H, W]``: ``[tiles * img_seq_len, hidden]`` rows, tile-major."""
        from megatron.core.models.multimodal.llava_model import pixel_shuffle

        llava = self.llava
        embeddings = self._vision_model(images)  # [tiles, seq, h_vision]
        if llava._drop_vision_class_token:
            embeddings = embeddings[:, self._vision_model.class_token_len :, :]
        if llava._pixel_shuffle:
            embeddings = pixel_shuffle(embeddings)
        projected = self._projection(embeddings.permute(1, 0, 2).contiguous())  # [seq, tiles, h]
        return projected.permute(1, 0, 2).reshape(-1, projected.shape[-1])

    def encode_fn(self, load: Callable[[UnitKey], torch.Tensor]) -> EncodeFn:
        """knitkit's encoder function: one vision pass over every tile of an encoder micro-batch."""

        def encode(keys: Sequence[UnitKey]) -> torch.Tensor:
            images = [load(key) for key in keys]
            return self.encode(torch.cat(images)) if images else self._empty()

        return encode

    def forward(self, batch: Mapping[str, object]) -> tuple[torch.Tensor, torch.Tensor]:
        """The language model on one packed micro-batch, image rows from the dedup cache.

        ``batch`` is ``megatron_batch``'s output over ``llava_sequence`` fields (stored labels,
        LLaVA's loss mask); returns ``(per-token loss, loss_mask)`` like ``LLaVAModel.forward``.
        """
        from megatron.core import tensor_parallel

        llava = self.llava
        tokens = _tensor(batch, "tokens")
        at_image = tokens == llava.image_token_index
        embeddings = llava.language_model.embedding(
            input_ids=tokens.masked_fill(at_image, 0), position_ids=_tensor(batch, "position_ids")
        )  # [T, 1, h]
        rows = llava.vision_projection()  # DedupVLMStep's lookup: this micro-batch's image rows
        mask = at_image.t().unsqueeze(-1).expand_as(embeddings)
        embeddings = embeddings.masked_scatter(mask, rows.to(embeddings.dtype))
        if llava.sequence_parallel_lm:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
        output = llava.language_model(
            input_ids=None,
            position_ids=None,
            attention_mask=batch.get("attention_mask"),
            decoder_input=embeddings,
            labels=_tensor(batch, "labels"),
            packed_seq_params=batch.get("packed_seq_params"),
        )
        return output, _tensor(batch, "loss_mask")

    def _empty(self) -> torch.Tensor:
        weight = next(self._projection.parameters())
        return weight.new_empty(0, self.llava.config.hidden_size)


def _tensor(batch: Mapping[str, object], key: str) -> torch.Tensor:
    value = batch[key]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"batch[{key!r}] is {type(value).__name__}, expected a tensor")
    return value
