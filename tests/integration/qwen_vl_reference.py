"""transformers' Qwen-VL ``get_rope_index`` (the installed 5.23.0, real code) as the reference for knitkit's
mRoPE positions: tiny models without weights, the processor's own ``mm_token_type_ids`` rule."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

IMAGE_TOKEN, VIDEO_TOKEN = 151655, 151656
"""Qwen2.5-VL's and Qwen3-VL's ``<|image_pad|>`` and ``<|video_pad|>`` (their configs' defaults)."""
VISION_START, VISION_END = 151652, 151653
"""``<|vision_start|>`` and ``<|vision_end|>``: the processors wrap every image, every Qwen2.5-VL
video and every Qwen3-VL video frame in them (text tokens to the model)."""
MERGE = 2
TOKENS_PER_SECOND = 2
"""``vision_config.tokens_per_second`` of the released Qwen2.5-VL checkpoints."""

Grid = tuple[int, int, int]


@functools.cache
def model(scheme: str) -> Any:
    """A Qwen2.5-VL or Qwen3-VL model of hidden size 8 (1.2M parameters): only its
    ``get_rope_index`` and ``compute_3d_position_ids`` are used, which read its config."""
    tiny_text = {
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "intermediate_size": 8,
        "vocab_size": 152064,
    }
    tiny_vision = {
        "depth": 1,
        "hidden_size": 8,
        "num_heads": 1,
        "out_hidden_size": 8,
        "intermediate_size": 8,
        "spatial_merge_size": MERGE,
    }
    if scheme == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        config = Qwen2_5_VLConfig(
            vision_config={**tiny_vision, "tokens_per_second": TOKENS_PER_SECOND},
            text_config=tiny_text,
        )
        built = Qwen2_5_VLModel(config)
    else:
        from transformers import Qwen3VLConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

        config = Qwen3VLConfig(
            vision_config={**tiny_vision, "deepstack_visual_indexes": []},
            text_config={**tiny_text, "head_dim": 8},
        )
        built = Qwen3VLModel(config)
    assert (config.image_token_id, config.video_token_id) == (IMAGE_TOKEN, VIDEO_TOKEN)
    return built


def token_types(input_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """``mm_token_type_ids`` as the Qwen-VL processors build them (``ProcessorMixin.create_mm_token_type_ids``)."""
    from transformers.processing_utils import ProcessorMixin

    ids = SimpleNamespace(
        image_token_ids=[IMAGE_TOKEN], video_token_ids=[VIDEO_TOKEN], audio_token_ids=[None]
    )
    return torch.tensor(ProcessorMixin.create_mm_token_type_ids(ids, [list(s) for s in input_ids]))


def _grids(grids: Sequence[Grid]) -> torch.Tensor | None:
    return torch.tensor(grids, dtype=torch.long).reshape(-1, 3) if len(grids) else None


def get_rope_index(
    scheme: str,
    sequences: Sequence[Sequence[int]],
    image_grid_thw: Sequence[Grid] = (),
    video_grid_thw: Sequence[Grid] = (),
    second_per_grid_ts: Sequence[float] = (),
    *,
    padding: str = "right",
    pad_id: int = 0,
) -> list[np.ndarray]:
    """``[3, len]`` positions of each sequence from ONE padded batch call, as a processor batch
    feeds the model: grids (and seconds) of all sequences in batch order, ``attention_mask``
    marking the padding on ``padding`` ("left" or "right")."""
    width = max(len(s) for s in sequences)
    rows, mask = [], []
    for sequence in sequences:
        pad = [pad_id] * (width - len(sequence))
        keep = [1] * len(sequence)
        rows.append([*pad, *sequence] if padding == "left" else [*sequence, *pad])
        mask.append([0] * len(pad) + keep if padding == "left" else keep + [0] * len(pad))
    input_ids = torch.tensor(rows, dtype=torch.long)
    attention = torch.tensor(mask, dtype=torch.long)
    kwargs: dict[str, Any] = {}
    if scheme == "qwen2_5_vl" and len(second_per_grid_ts):
        kwargs["second_per_grid_ts"] = torch.tensor(second_per_grid_ts, dtype=torch.float32)
    positions, _ = model(scheme).get_rope_index(
        input_ids,
        token_types(rows),
        image_grid_thw=_grids(image_grid_thw),
        video_grid_thw=_grids(video_grid_thw),
        attention_mask=attention,
        **kwargs,
    )
    return [positions[:, i, attention[i].bool()].numpy() for i in range(len(sequences))]


class _FilledCache:
    """What ``compute_3d_position_ids`` asks a KV cache: how many tokens it already holds."""

    def __init__(self, length: int) -> None:
        self.length = length

    def get_seq_length(self) -> int:
        return self.length


def generation_positions(
    scheme: str,
    prompt: Sequence[int],
    generated: int,
    image_grid_thw: Sequence[Grid] = (),
    video_grid_thw: Sequence[Grid] = (),
    second_per_grid_ts: Sequence[float] = (),
) -> np.ndarray:
    """``[3, len(prompt) + generated]``: the prompt's positions and those of ``generated`` tokens
    decoded after it, through the model's own generation path (``compute_3d_position_ids``:
    ``get_rope_index`` on the prefill, then ``rope_deltas`` on each decode step)."""
    built = model(scheme)
    built.rope_deltas = None
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    kwargs: dict[str, Any] = {}
    if scheme == "qwen2_5_vl" and len(second_per_grid_ts):
        kwargs["second_per_grid_ts"] = torch.tensor(second_per_grid_ts, dtype=torch.float32)
    prefill = built.compute_3d_position_ids(
        input_ids=ids,
        image_grid_thw=_grids(image_grid_thw),
        video_grid_thw=_grids(video_grid_thw),
        inputs_embeds=None,
        attention_mask=None,
        past_key_values=None,
        mm_token_type_ids=token_types(ids.tolist()),
        **kwargs,
    )
    steps = [prefill[:, 0]]
    for k in range(generated):
        step = built.compute_3d_position_ids(
            input_ids=torch.tensor([[0]]),
            image_grid_thw=None,
            video_grid_thw=None,
            inputs_embeds=torch.zeros(1, 1, 8),
            attention_mask=None,
            past_key_values=_FilledCache(len(prompt) + k),
        )
        steps.append(step[:, 0])
    return torch.cat(steps, dim=1).numpy()
