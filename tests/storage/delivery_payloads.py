"""Checkable trajectory payloads for the delivery tests: every token id encodes (trajectory, position)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.planning.plan import MiniBatchPlan, Topology
from knitkit.storage.planning.planner import PlannerConfig, plan_minibatch
from knitkit.types import TrajectoryMeta, UnitKey

POSITION_BITS = 20
TOKEN_FIELDS = ("tokens", "logprobs", "routing")
ROUTING_ROW = (3, 2)


def make_metas(lengths: Sequence[int], group_size: int = 2) -> list[TrajectoryMeta]:
    return [
        TrajectoryMeta(f"t{i}", f"s{i // group_size}", "src", 0, int(n), 0, 0)
        for i, n in enumerate(lengths)
    ]


def fill_backend(backend: UnitBackend, metas: Sequence[TrajectoryMeta]) -> int:
    """Put tokens / logprobs / routing / reward of every trajectory; returns total tokens."""
    for index, meta in enumerate(metas):
        tokens = (index << POSITION_BITS) + np.arange(meta.num_tokens, dtype=np.int32)
        backend.put(UnitKey(meta.trajectory_id, "tokens"), tokens)
        backend.put(UnitKey(meta.trajectory_id, "logprobs"), -tokens.astype(np.float32))
        routing = np.broadcast_to(
            (tokens % 251).astype(np.uint8)[:, None, None], (len(tokens), *ROUTING_ROW)
        )
        backend.put(UnitKey(meta.trajectory_id, "routing"), np.ascontiguousarray(routing))
        backend.put(UnitKey(meta.trajectory_id, "reward"), np.float32(index))
    return sum(m.num_tokens for m in metas)


def plan_for(
    metas: Sequence[TrajectoryMeta], topology: Topology, budget: int | None, name: str
) -> MiniBatchPlan:
    config = PlannerConfig(
        token_fields=TOKEN_FIELDS,
        scalar_fields=("reward",),
        max_tokens_per_micro_batch=budget,
        min_micro_batches=2,
    )
    return plan_minibatch(metas, topology, config, minibatch_id=name)


def real_tokens(fields: dict[str, np.ndarray]) -> np.ndarray:
    """The token ids of one packed micro-batch that are not padding, after checking every field.

    Logprobs, routing and position ids must describe the same token row by row.
    """
    real = fields["loss_mask"] > 0
    tokens = fields["tokens"][real]
    assert np.array_equal(fields["logprobs"][real], -tokens.astype(np.float32))
    assert np.array_equal(fields["routing"][real][:, 0, 0], (tokens % 251).astype(np.uint8))
    assert np.array_equal(fields["position_ids"][real], tokens & ((1 << POSITION_BITS) - 1))
    assert not fields["tokens"][~real].any()
    return tokens.astype(np.int64)
