"""A rollout stand-in: GRPO groups from several sources, with images, completing over simulated time."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from knitkit.admission.replay import SourceProfile, generate_trace
from knitkit.next_token import next_token_fields
from knitkit.storage import MultimodalInput, Trajectory

PROMPT_TOKENS = 6
"""Text tokens before the image placeholder."""


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """Shape of the stand-in rollout."""

    sources: tuple[SourceProfile, ...]
    group_size: int = 8
    groups_per_source_per_step: int = 2
    rollout_steps: int = 3
    step_interval_s: float = 600.0
    """Simulated time between the issue of consecutive rollout steps."""
    min_tokens: int = 48
    max_tokens: int = 240
    image_patches: tuple[int, int] = (16, 40)
    patch_dim: int = 48
    routing_layers: int = 8
    routing_topk: int = 2
    vocab: int = 64
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Completion:
    """One finished trajectory and the simulated time it finished at."""

    time_s: float
    trajectory: Trajectory


def stream_completions(config: RolloutConfig) -> Iterator[Completion]:
    """Every trajectory of every rollout step, in completion order (issue time + duration)."""
    events: list[Completion] = []
    for step in range(config.rollout_steps):
        trace = generate_trace(
            config.sources,
            samples_per_source=config.groups_per_source_per_step,
            group_size=config.group_size,
            seed=config.seed * 1000 + step,
        )
        rng = np.random.default_rng([config.seed, step])
        for source, records in trace.records.items():
            groups = [
                records[i : i + config.group_size]
                for i in range(0, len(records), config.group_size)
            ]
            for group in groups:
                sample_id = f"step{step}-{group[0].sample_id}"
                image = _image(rng, config)
                noise = rng.uniform(0.0, 0.6, len(group))
                advantages = (noise.mean() - noise).astype(np.float32)
                for j, record in enumerate(group):
                    trajectory = _trajectory(
                        rng,
                        config,
                        f"{sample_id}-r{j}",
                        sample_id,
                        source,
                        step,
                        image,
                        float(noise[j]),
                        advantages[j],
                    )
                    finished = step * config.step_interval_s + record.duration_s
                    events.append(Completion(finished, trajectory))
    events.sort(key=lambda e: e.time_s)
    yield from events


def _image(rng: np.random.Generator, config: RolloutConfig) -> np.ndarray:
    low, high = config.image_patches
    patches = int(rng.integers(low, high + 1))
    return rng.standard_normal((patches, config.patch_dim), dtype=np.float32)


def _trajectory(
    rng: np.random.Generator,
    config: RolloutConfig,
    trajectory_id: str,
    sample_id: str,
    source: str,
    step: int,
    image: np.ndarray,
    noise: float,
    advantage: np.float32,
) -> Trajectory:
    """Token ids, next-token labels, rollout log-probs, loss mask, MoE routing and a GRPO advantage.

    Responses follow a fixed next-token rule except for a ``noise`` fraction of random tokens;
    the reward is the rule-following fraction, so the group-relative advantage teaches the rule
    and the loss falls over the demo's few steps.
    """
    patches = image.shape[0]
    prompt = PROMPT_TOKENS + patches
    length = int(rng.integers(max(config.min_tokens, prompt + 8), config.max_tokens + 1))
    tokens = np.empty(length, np.int64)
    tokens[0] = rng.integers(1, config.vocab)
    random_tokens = rng.integers(1, config.vocab, length)
    is_noise = rng.random(length) < noise
    for t in range(1, length):
        tokens[t] = random_tokens[t] if is_noise[t] else (tokens[t - 1] * 5 + 3) % config.vocab
    generated = np.zeros(length, np.float32)
    generated[prompt:] = 1.0
    routing = rng.integers(0, 64, (length, config.routing_layers, config.routing_topk)).astype(
        np.uint8
    )
    token_aligned: dict[str, np.ndarray] = {
        "tokens": tokens,
        "logprobs": np.full(length, -np.log(config.vocab), np.float32),
        "loss_mask": generated,
        "routing": routing,
    }
    return Trajectory(
        trajectory_id=trajectory_id,
        sample_id=sample_id,
        # see NOTE [ Next-token alignment ]: labels, mask and log-probs at the predicting position
        token_fields=next_token_fields(token_aligned, ("loss_mask", "logprobs")),
        scalars={"advantage": advantage},
        multimodal=(MultimodalInput("image", image, PROMPT_TOKENS, patches),),
        source=source,
        rollout_step=step,
        min_version=step,
        max_version=step,
    )


def default_sources(names: Sequence[str] = ("A", "B", "C", "D")) -> tuple[SourceProfile, ...]:
    """Four sources whose durations spread several-fold, like the paper's Figure 3(a)."""
    medians = (60.0, 120.0, 200.0, 420.0)
    return tuple(
        SourceProfile(name=name, median_s=median, sigma=0.5, cap_factor=3.0)
        for name, median in zip(names, medians, strict=True)
    )
