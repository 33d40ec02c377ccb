"""Qwen-VL style multimodal RoPE under knitkit: 3-D position ids as a stored per-token field.

Qwen2.5-VL and Qwen3-VL give every token a (temporal, height, width) position: text tokens advance
all three together, an image's or a video's tokens spread over its merged (t, h, w) grid
(``get_rope_index`` in transformers). The positions depend on the whole sequence, so they are
computed ONCE at write time (``mrope_positions``), stored as the per-token field
``mrope_position_ids`` ``[T, 3]`` and planned, CP-sliced and packed like the tokens; the trainer
only reshapes them for megatron-core (``mrope_position_ids``), never recomputes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from knitkit.integration.megatron.batch import Batch
from knitkit.integration.megatron.te import batch_for
from knitkit.microbatch_iter import MicroBatch
from knitkit.storage.planning import rank_chunks

MROPE_FIELD = "mrope_position_ids"
"""The stored per-token field: int64 ``[T, 3]`` (temporal, height, width) per token."""

MRopeScheme = Literal["qwen2_5_vl", "qwen3_vl"]
"""How videos are laid out and timed: Qwen2.5-VL (one run per video, absolute time in the temporal
index) or Qwen3-VL and Qwen3-VL-MoE (one run per temporal patch, time as timestamp text)."""
MROPE_SCHEMES: tuple[MRopeScheme, ...] = ("qwen2_5_vl", "qwen3_vl")

Grid = tuple[int, int, int]
"""A processor's ``(t, h, w)`` grid, in patches."""

# NOTE [ Qwen-VL mRoPE positions ]: the walk over one sequence, text and vision runs in order.
# - Text: consecutive positions on all three axes from the next free position p.
# - A vision run (the processor's consecutive placeholder tokens) of merged grid
#   (t, h', w') = (t, h / m, w / m), m = spatial_merge_size, takes temporal p + trunc(k * interval)
#   for temporal step k, height p + row, width p + column (t, h', w' order). The next text
#   starts at max(block) + 1.
# - Qwen2.5-VL ("qwen2_5_vl"): a video is ONE run of t * h' * w' tokens; interval =
#   tokens_per_second * second_per_grid_t (vision config; processor's temporal_patch_size / fps
#   per video), in float32 as the processor's float32 second_per_grid_ts tensor makes transformers
#   compute it. Images have t = 1 (interval 1, as transformers).
# - Qwen3-VL ("qwen3_vl", also Qwen3-VL-MoE): the processor writes each temporal patch of a video
#   as its own run (<t seconds><|vision_start|> + h' * w' video tokens + <|vision_end|>), so a
#   video grid (t, h, w) is t runs of grid (1, h, w); time lives in the timestamp text and
#   second_per_grid_ts is not used.
# - Each run holds exactly its grid's tokens; images and videos meet runs in order of appearance;
#   every grid needs a run. Anything else is refused, naming the item: a silent mismatch shifts
#   every later position.
# The processor wraps every image, every Qwen2.5-VL video and every Qwen3-VL video frame in
# <|vision_start|> ... <|vision_end|>, plain text to the model, so text always follows a run.
# The rule per model family (text after a run, and tokens generated after the prompt):
# - Images (every family), Qwen3-VL / Qwen3-VL-MoE video frames (t = 1 per run): the next text is
#   at max + 1 = p + max(h', w'). Qwen's own implementation, SGLang, vLLM and transformers 5.x
#   (prefill and generation) all agree.
# - Qwen2.5-VL videos: the next text is at max + 1 = p + max(trunc((t - 1) * interval),
#   max(h', w') - 1) + 1: Qwen's own implementation (transformers PR 35569: "the text start
#   position_ids as the max vision position_ids plus 1"), SGLang's and vLLM's
#   MRotaryEmbedding.get_rope_index. transformers 5.x (5.23.0 included) continues at
#   p + max(h', w') in its prefill and generates from the prefill's max + 1: the same where the
#   temporal extent trunc((t - 1) * interval) fits in max(h', w') - 1; past it, its text after the
#   video sits lower, and with only <|vision_end|> after the video its generated answer sits
#   exactly 1 below (a token's position then depends on whether it was prefilled or decoded).
# knitkit follows max + 1: the rollout engine (SGLang, vLLM) computed the log-probs with it, the
# trainer must see the positions the rollout saw, and in a multi-turn episode each turn's output is
# prefilled again in the next turn's prompt, so a position must not depend on prefill vs decode.
# tests/integration/test_mrope_reference.py runs transformers 5.23.0's real get_rope_index and
# generation path on the processor's layout: equal wherever transformers follows max + 1, and the
# Qwen2.5-VL overhang case pinned to the difference above.


@dataclass(frozen=True, slots=True)
class _Run:
    """One grid the sequence must hold as a run of placeholder tokens."""

    kind: Literal["image", "video"]
    index: int
    """The image's or video's index (a Qwen3-VL video has one run per temporal patch)."""
    grid: Grid
    interval: float
    merge: int

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * (h // self.merge) * (w // self.merge)

    def positions(self, start: int) -> np.ndarray:
        """``[3, num_tokens]`` positions from ``start`` (see NOTE [ Qwen-VL mRoPE positions ])."""
        t, h, w = self.grid[0], self.grid[1] // self.merge, self.grid[2] // self.merge
        steps = (np.arange(t, dtype=np.float32) * np.float32(self.interval)).astype(np.int64)
        block = np.empty((3, t, h, w), dtype=np.int64)
        block[0] = steps[:, None, None]
        block[1] = np.arange(h)[None, :, None]
        block[2] = np.arange(w)[None, None, :]
        return block.reshape(3, -1) + start


def placeholder_runs(input_ids: Sequence[int] | np.ndarray, token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every maximal run of ``token_id`` in ``input_ids``."""
    ids = np.asarray(input_ids)
    mask = np.concatenate(([False], ids == token_id, [False]))
    edges = np.flatnonzero(mask[1:] != mask[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def mrope_positions(
    input_ids: Sequence[int] | np.ndarray,
    image_grid_thw: Sequence[Grid] = (),
    *,
    image_token_id: int,
    spatial_merge_size: int = 2,
    video_grid_thw: Sequence[Grid] = (),
    video_token_id: int | None = None,
    second_per_grid_ts: Sequence[float] = (),
    tokens_per_second: float | None = None,
    scheme: MRopeScheme = "qwen2_5_vl",
) -> np.ndarray:
    """``[3, T]`` position ids of one sequence, as the Qwen-VL model of ``scheme`` computes them.

    ``input_ids`` holds the processor-expanded placeholders; ``image_grid_thw``,
    ``video_grid_thw`` and ``second_per_grid_ts`` are the processor's outputs for this sequence
    (in patches, one per image / video); ``image_token_id``, ``video_token_id``,
    ``spatial_merge_size`` and ``tokens_per_second`` come from the model config. See NOTE
    [ Qwen-VL mRoPE positions ] for the rule per model family, and where transformers 5.x differs.
    """
    if scheme not in MROPE_SCHEMES:
        raise ValueError(f"mRoPE scheme {scheme!r} is not one of {MROPE_SCHEMES}")
    if len(video_grid_thw) and video_token_id is None:
        raise ValueError("video_grid_thw given without video_token_id; pass the model config's")
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    expected = {
        "image": _image_runs(image_grid_thw, spatial_merge_size),
        "video": _video_runs(
            video_grid_thw, second_per_grid_ts, tokens_per_second, spatial_merge_size, scheme
        ),
    }
    token_of = {"image": image_token_id, "video": video_token_id}
    found = sorted(
        (start, length, kind)
        for kind, token in token_of.items()
        if token is not None
        for start, length in placeholder_runs(ids, token)
    )
    for kind, runs in expected.items():
        seen = sum(1 for *_, k in found if k == kind)
        if seen != len(runs):
            unit = "temporal patches (Qwen3-VL: one run each)" if scheme == "qwen3_vl" else "grids"
            raise ValueError(
                f"{len(runs)} {kind} {unit} from {kind}_grid_thw but {seen} runs of {kind} token "
                f"{token_of[kind]} in input_ids; pass the processor's {kind}_grid_thw with its "
                "expanded input_ids, one grid per placeholder run"
            )
    out = np.empty((3, len(ids)), dtype=np.int64)
    cursor = position = 0
    taken = {"image": 0, "video": 0}
    for start, length, kind in found:
        run = expected[kind][taken[kind]]
        taken[kind] += 1
        if length != run.num_tokens:
            raise ValueError(
                f"{kind} {run.index}: grid {run.grid} needs {run.num_tokens} {kind} tokens "
                f"(id {token_of[kind]}) in one run at spatial_merge_size={run.merge}, but the run "
                f"at position {start} has {length}; expand the placeholders as the processor does"
            )
        out[:, cursor:start] = np.arange(position, position + start - cursor)
        position += start - cursor
        block = run.positions(position)
        out[:, start : start + length] = block
        position = int(block.max()) + 1  # see NOTE [ Qwen-VL mRoPE positions ]
        cursor = start + length
    out[:, cursor:] = np.arange(position, position + len(ids) - cursor)
    return out


def _image_runs(grids: Sequence[Grid], merge: int) -> list[_Run]:
    return [_Run("image", i, _grid(g, "image", i, merge), 1.0, merge) for i, g in enumerate(grids)]


def _video_runs(
    grids: Sequence[Grid],
    second_per_grid_ts: Sequence[float],
    tokens_per_second: float | None,
    merge: int,
    scheme: MRopeScheme,
) -> list[_Run]:
    seconds = np.asarray(second_per_grid_ts, dtype=np.float32).reshape(-1)
    checked = [_grid(g, "video", i, merge) for i, g in enumerate(grids)]
    if scheme == "qwen3_vl":
        if len(seconds):
            raise ValueError(
                "second_per_grid_ts given with scheme 'qwen3_vl': Qwen3-VL puts time in timestamp "
                "text, not positions; use scheme 'qwen2_5_vl' for Qwen2.5-VL"
            )
        return [
            _Run("video", i, (1, h, w), 1.0, merge)
            for i, (t, h, w) in enumerate(checked)
            for _ in range(t)
        ]
    if not checked:
        return []
    if len(seconds) != len(checked):
        raise ValueError(
            f"{len(checked)} video_grid_thw but {len(seconds)} second_per_grid_ts; Qwen2.5-VL "
            "needs the processor's second_per_grid_ts (temporal_patch_size / fps), one per video"
        )
    if tokens_per_second is None:
        raise ValueError(
            "Qwen2.5-VL videos need tokens_per_second (the model's vision_config.tokens_per_second, "
            "2 in the released checkpoints)"
        )
    return [
        _Run("video", i, grid, float(np.float32(tokens_per_second) * seconds[i]), merge)
        for i, grid in enumerate(checked)
    ]


def _grid(grid: Sequence[int], kind: str, index: int, merge: int) -> Grid:
    t, h, w = (int(x) for x in grid)
    if min(t, h, w) < 1 or h % merge or w % merge:
        raise ValueError(
            f"{kind} {index}: grid {(t, h, w)} is not a processor grid at spatial_merge_size="
            f"{merge} (positive, h and w multiples of the merge size)"
        )
    return t, h, w


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
