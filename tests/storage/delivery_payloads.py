"""Checkable trajectory payloads for the delivery tests: every token id encodes (trajectory, position)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.planning.plan import MiniBatchPlan, Topology
from knitkit.storage.planning.planner import PlannerConfig, plan_minibatch
from knitkit.storage.units.payload import Trajectory
from knitkit.types import TrajectoryMeta, UnitKey

POSITION_BITS = 20
TOKEN_FIELDS = ("tokens", "logprobs", "routing")
ROUTING_ROW = (3, 2)


def make_metas(lengths: Sequence[int], group_size: int = 2) -> list[TrajectoryMeta]:
    return [
        TrajectoryMeta(f"t{i}", f"s{i // group_size}", "src", 0, int(n), 0, 0)
        for i, n in enumerate(lengths)
    ]


def payload(index: int, num_tokens: int) -> dict[str, np.ndarray]:
    """tokens / logprobs / routing / reward of trajectory ``index``: every token id encodes
    (trajectory, position)."""
    tokens = (index << POSITION_BITS) + np.arange(num_tokens, dtype=np.int32)
    routing = np.broadcast_to(
        (tokens % 251).astype(np.uint8)[:, None, None], (len(tokens), *ROUTING_ROW)
    )
    return {
        "tokens": tokens,
        "logprobs": -tokens.astype(np.float32),
        "routing": np.ascontiguousarray(routing),
        "reward": np.asarray(np.float32(index)),
    }


def fill_backend(backend: UnitBackend, metas: Sequence[TrajectoryMeta]) -> int:
    """Put tokens / logprobs / routing / reward of every trajectory; returns total tokens."""
    for index, meta in enumerate(metas):
        for name, array in payload(index, meta.num_tokens).items():
            backend.put(UnitKey(meta.trajectory_id, name), array)
    return sum(m.num_tokens for m in metas)


def trajectories(metas: Sequence[TrajectoryMeta]) -> list[Trajectory]:
    """The same payloads as ``fill_backend``, as trajectories for ``TrajectoryStore.write``."""
    out = []
    for index, meta in enumerate(metas):
        fields = payload(index, meta.num_tokens)
        reward = fields.pop("reward")
        out.append(Trajectory(meta.trajectory_id, meta.sample_id, fields, {"reward": reward}))
    return out


def plan_for(
    metas: Sequence[TrajectoryMeta],
    topology: Topology,
    budget: int | None,
    name: str,
    *,
    keep_groups: bool = False,
) -> MiniBatchPlan:
    config = PlannerConfig(
        token_fields=TOKEN_FIELDS,
        scalar_fields=("reward",),
        max_tokens_per_micro_batch=budget,
        min_micro_batches=2,
        keep_groups=keep_groups,
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
