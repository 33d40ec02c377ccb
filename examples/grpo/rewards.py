"""Rewards of the stand-in's responses and GRPO's group-normalised advantages."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

ADVANTAGE_EPS = 1e-6


def rule(token: int, vocab: int) -> int:
    """The next token a perfect response writes (tokens ``4 .. vocab - 1``)."""
    return 4 + (5 * (token - 4) + 3) % (vocab - 4)


def reward(output_ids: Sequence[int], vocab: int) -> float:
    """The fraction of a response's steps that follow ``rule`` (a verifiable reward)."""
    steps = len(output_ids) - 1
    if steps <= 0:
        return 0.0
    hits = sum(rule(a, vocab) == b for a, b in itertools.pairwise(output_ids))
    return hits / steps


def group_advantages(rewards: Sequence[float]) -> tuple[float, ...]:
    """GRPO: ``(r - mean) / (std + eps)`` over one prompt's responses (unbiased std, as verl)."""
    values = np.asarray(rewards, dtype=np.float64)
    std = values.std(ddof=1) if len(values) > 1 else 0.0
    return tuple(float(a) for a in (values - values.mean()) / (std + ADVANTAGE_EPS))
