"""Qwen-VL style multimodal RoPE under knitkit: 3-D position ids as a stored per-token field.

Qwen2.5-VL gives every token a (temporal, height, width) position: text tokens advance all three
together, an image's tokens take their merged-grid row and column after the preceding text
(``get_rope_index`` in transformers). The positions depend on the whole sequence, so they are
computed ONCE at write time (``mrope_positions``), stored as the per-token field
``mrope_position_ids`` ``[T, 3]`` and planned, CP-sliced and packed like the tokens; the trainer
only reshapes them for megatron-core (``mrope_position_ids``), never recomputes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from knitkit.integration.megatron.batch import Batch
from knitkit.integration.megatron.te import batch_for
from knitkit.microbatch_iter import MicroBatch
from knitkit.storage.planning import rank_chunks

MROPE_FIELD = "mrope_position_ids"
"""The stored per-token field: int64 ``[T, 3]`` (temporal, height, width) per token."""


def mrope_positions(
    input_ids: np.ndarray,
    image_grid_thw: Sequence[tuple[int, int, int]],
    *,
    image_token_id: int,
    spatial_merge_size: int = 2,
) -> np.ndarray:
    """``[3, T]`` position ids of one sequence, as Qwen2.5-VL's ``get_rope_index`` computes them for images.

    ``input_ids`` holds the processor-expanded image tokens: image ``i`` with grid ``(t, h, w)``
    (in patches) takes ``t * h * w / spatial_merge_size**2`` consecutive ``image_token_id``s.
    Text after position ``p`` continues at ``max(positions so far) + 1`` on all three axes; an
    image starts at the next text position and spreads over its merged grid (images have one
    temporal step, so their temporal index stays at the start).
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    pieces: list[np.ndarray] = []
    start = 0
    next_position = 0
    for t, h, w in image_grid_thw:
        grid_h, grid_w = h // spatial_merge_size, w // spatial_merge_size
        rows = t * grid_h * grid_w
        hits = np.flatnonzero(ids[start:] == image_token_id)
        if len(hits) == 0 or start + hits[0] + rows > len(ids):
            raise ValueError(
                f"image grid {(t, h, w)} needs {rows} image tokens {image_token_id} after "
                f"position {start}; expand the image tokens as the processor does"
            )
        text = int(hits[0])
        pieces.append(np.broadcast_to(np.arange(text) + next_position, (3, text)))
        base = next_position + text
        t_index = np.zeros(rows, dtype=np.int64)  # Qwen2.5-VL: images have no temporal spread
        h_index = np.broadcast_to(np.arange(grid_h)[None, :, None], (t, grid_h, grid_w)).ravel()
        w_index = np.broadcast_to(np.arange(grid_w)[None, None, :], (t, grid_h, grid_w)).ravel()
        image = np.stack([t_index, h_index, w_index]) + base
        pieces.append(image)
        next_position = int(image.max()) + 1
        start += text + rows
    tail = len(ids) - start
    pieces.append(np.broadcast_to(np.arange(tail) + next_position, (3, tail)))
    return np.concatenate(pieces, axis=1).astype(np.int64)


def mrope_position_ids(
    packed: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int = 1, cp_rank: int = 0
) -> torch.Tensor:
    """megatron-core's ``position_ids`` ``[3, 1, S]`` from a packed ``mrope_position_ids`` field ``[T, 3]``.

    At CP=1, ``S = T``. Under CP with THD, megatron's RoPE maps a FULL-length table through each
    sequence's offset onto this rank's chunks (``_apply_rotary_pos_emb_thd``), so the local rows
    are placed at their full-sequence positions (zeros elsewhere, never read by this rank). Build
    the language model with its rotary ``cp_group`` unset (``disable_rotary_cp_slicing``) so the
    table is not sliced a second time.
    """
    local = packed.long().t()[:, None, :]
    if cp_size == 1:
        return local
    lengths = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).cpu().numpy()
    index = torch.cat(
        [
            torch.arange(a, b) + int(offset)
            for offset, chunks in zip(
                cu_seqlens_padded[:-1].tolist(), rank_chunks(lengths, cp_size, cp_rank), strict=True
            )
            for a, b in chunks
        ]
    ).to(packed.device)
    full = local.new_zeros(3, 1, int(cu_seqlens_padded[-1]))
    full[:, :, index] = local
    return full


def disable_rotary_cp_slicing(language_model: torch.nn.Module) -> None:
    """Stop megatron's mRoPE module from CP-slicing its table (knitkit's positions place it already).

    ``MultimodalRotaryEmbedding`` slices its output with the sbhd zigzag whenever its CP group
    has more than one rank; with THD packing the attention's RoPE picks each rank's rows itself.
    """
    rotary = getattr(language_model, "rotary_pos_emb", None)
    if rotary is None or not hasattr(rotary, "cp_group"):
        raise ValueError(
            "the language model has no mRoPE module (rotary_pos_emb.cp_group); build it with "
            "position_embedding_type='mrope'"
        )
    rotary.cp_group = None


def mrope_batch(
    micro_batch: MicroBatch, *, use_te: bool, cp_size: int = 1, cp_rank: int = 0
) -> Batch:
    """``batch_for(use_te, cp_size)`` plus megatron's mRoPE ``position_ids`` from the stored field."""
    if MROPE_FIELD not in micro_batch.tensors:
        raise KeyError(
            f"micro-batch has no {MROPE_FIELD!r} field; store mrope_positions(...).T per "
            f"trajectory and plan it with token_fields=(..., {MROPE_FIELD!r})"
        )
    batch = batch_for(use_te, cp_size)(micro_batch)
    batch["position_ids"] = mrope_position_ids(
        micro_batch[MROPE_FIELD], micro_batch["cu_seqlens_padded"], cp_size, cp_rank
    )
    return batch
