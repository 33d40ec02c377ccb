"""The planner's input as columns: trajectory metadata read once, validated once, at the boundary."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from knitkit.types import MultimodalRef, TrajectoryMeta


@dataclass(frozen=True, slots=True)
class MetaColumns:
    """The accepted trajectories of a mini-batch, one list per field, in input order."""

    trajectory_ids: list[str]
    sample_ids: list[str]
    num_tokens: list[int]
    multimodal: list[tuple[MultimodalRef, ...]]

    @classmethod
    def of(cls, metas: Sequence[TrajectoryMeta]) -> MetaColumns:
        """Columns of ``metas``' accepted trajectories, after checking all of them: every
        trajectory given once, each multimodal input inside its trajectory's tokens (otherwise
        ``ValueError`` naming the trajectory and the input).

        Every pass runs in C (``map`` over ``attrgetter``), so reading 16k trajectories costs
        about a millisecond.
        """
        ids = list(map(attrgetter("trajectory_id"), metas))
        tokens = list(map(attrgetter("num_tokens"), metas))
        multimodal = list(map(attrgetter("multimodal"), metas))
        _check(metas, ids, tokens, multimodal)
        accepted = list(map(attrgetter("accepted"), metas))
        if all(accepted):
            samples = list(map(attrgetter("sample_id"), metas))
            return cls(ids, samples, tokens, multimodal)
        kept = list(itertools.compress(metas, accepted))
        return cls(
            list(itertools.compress(ids, accepted)),
            list(map(attrgetter("sample_id"), kept)),
            list(itertools.compress(tokens, accepted)),
            list(itertools.compress(multimodal, accepted)),
        )


def _check(
    metas: Sequence[TrajectoryMeta],
    ids: list[str],
    tokens: list[int],
    multimodal: list[tuple[MultimodalRef, ...]],
) -> None:
    """The input checks of ``MetaColumns.of``; the first offender in input order is named."""
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        for tid in ids:
            if tid in seen:
                raise ValueError(
                    f"trajectory {tid!r} is given twice; pass each trajectory's "
                    "metadata once (its tokens would be delivered twice)"
                )
            seen.add(tid)
    refs = list(itertools.chain.from_iterable(multimodal))
    if not refs:
        return
    per_meta = np.fromiter(map(len, multimodal), dtype=np.int64, count=len(multimodal))
    start = np.fromiter(map(attrgetter("token_start"), refs), dtype=np.int64, count=len(refs))
    length = np.fromiter(map(attrgetter("num_tokens"), refs), dtype=np.int64, count=len(refs))
    limit = np.repeat(np.asarray(tokens, dtype=np.int64), per_meta)
    bad = (start < 0) | (length < 0) | (start + length > limit)
    if bad.any():
        j = int(bad.argmax())
        ref = refs[j]
        meta = metas[int(np.searchsorted(np.cumsum(per_meta), j, side="right"))]
        end = ref.token_start + ref.num_tokens
        raise ValueError(
            f"trajectory {meta.trajectory_id!r}: multimodal input {ref.key} covers "
            f"tokens [{ref.token_start}, {end}) outside its {meta.num_tokens} tokens"
        )
