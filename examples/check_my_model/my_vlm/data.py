"""The mini-batch: GRPO groups of 4 rollouts sharing their prompt's 1-2 images of 3-5 rows."""

from __future__ import annotations

import numpy as np

from knitkit.storage import MultimodalInput, Trajectory
from my_vlm.model import IMAGE_TOKEN, PATCH, VOCAB


def trajectories(seed: int = 0, prompts: int = 3, n: int = 4) -> list[Trajectory]:
    """``prompts`` x ``n`` trajectories; each image's placeholder tokens are ``IMAGE_TOKEN``."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(prompts):
        images, at = [], 1
        for _ in range(1 + p % 2):
            rows = int(rng.integers(3, 6))
            pixels = rng.standard_normal((rows, PATCH)).astype(np.float32)
            images.append(MultimodalInput("image", pixels, at, rows))
            at += rows + 2
        for r in range(n):
            tokens = rng.integers(8, VOCAB, size=at + int(rng.integers(6, 16))).astype(np.int64)
            for image in images:
                tokens[image.token_start : image.token_start + image.num_tokens] = IMAGE_TOKEN
            out.append(
                Trajectory(f"p{p}-r{r}", f"p{p}", {"tokens": tokens}, multimodal=tuple(images))
            )
    return out
