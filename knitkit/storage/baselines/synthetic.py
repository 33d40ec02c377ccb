"""Synthetic GRPO mini-batches (metadata only, or full payloads) for tests, benchmarks and the demo."""

from __future__ import annotations

import hashlib

import numpy as np

from knitkit.storage.units.payload import MultimodalInput, Trajectory
from knitkit.types import MultimodalRef, TrajectoryMeta, UnitKey


def synthetic_metas(
    num_trajectories: int,
    *,
    group_size: int = 8,
    min_tokens: int = 1024,
    max_tokens: int = 65536,
    image_tokens: int = 256,
    sources: int = 4,
    seed: int = 0,
) -> list[TrajectoryMeta]:
    """Trajectories in GRPO groups with log-uniform lengths; each sample shares one image."""
    rng = np.random.default_rng(seed)
    logs = rng.uniform(np.log(min_tokens), np.log(max_tokens), size=num_trajectories)
    lengths = np.maximum(np.exp(logs).astype(np.int64), image_tokens + 1)
    metas = []
    for i in range(num_trajectories):
        sample = i // group_size
        digest = hashlib.blake2b(f"image-{seed}-{sample}".encode(), digest_size=8).hexdigest()
        ref = MultimodalRef(UnitKey(digest, "image"), 0, image_tokens, float(image_tokens))
        metas.append(
            TrajectoryMeta(
                trajectory_id=f"s{sample}-t{i % group_size}",
                sample_id=f"s{sample}",
                source=f"src{sample % sources}",
                rollout_step=0,
                num_tokens=int(lengths[i]),
                min_version=0,
                max_version=0,
                multimodal=(ref,),
            )
        )
    return metas


def synthetic_trajectories(
    num_samples: int,
    *,
    group_size: int = 4,
    min_tokens: int = 64,
    max_tokens: int = 512,
    routing_layers: int = 4,
    routing_topk: int = 2,
    image_patches: int = 16,
    patch_dim: int = 32,
    sources: int = 2,
    seed: int = 0,
) -> list[Trajectory]:
    """GRPO groups of full payloads: tokens, logprobs, loss mask, MoE routing, top-p mask, reward,
    and one image per sample shared by the group's trajectories.

    Token ids are ``trajectory_number * 2**20 + position``, so a packed micro-batch tells exactly
    which trajectory tokens it holds (the exactly-once checks rely on it).
    """
    rng = np.random.default_rng(seed)
    out = []
    for sample in range(num_samples):
        image = rng.standard_normal((image_patches, patch_dim), dtype=np.float32)
        for j in range(group_size):
            number = sample * group_size + j
            length = int(rng.integers(max(min_tokens, image_patches + 1), max_tokens + 1))
            positions = np.arange(length, dtype=np.int64)
            out.append(
                Trajectory(
                    trajectory_id=f"s{sample}-t{j}",
                    sample_id=f"s{sample}",
                    source=f"src{sample % sources}",
                    token_fields={
                        "tokens": number * 2**20 + positions,
                        "logprobs": -rng.random(length, dtype=np.float32),
                        "loss_mask": (positions >= image_patches).astype(np.float32),
                        "routing": rng.integers(
                            0, 64, (length, routing_layers, routing_topk), dtype=np.uint8
                        ),
                        "topp_mask": rng.random(length) < 0.9,
                    },
                    scalars={"reward": np.array(rng.standard_normal(), dtype=np.float32)},
                    multimodal=(MultimodalInput("image", image, 0, image_patches),),
                )
            )
    return out
