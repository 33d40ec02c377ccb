"""Reused baseline buffers: the sample-level baseline reads and packs into memory allocated once."""

from __future__ import annotations

import numpy as np

from knitkit.storage import MemoryBackend, PlannerConfig, Topology, TrajectoryStore, plan_minibatch
from knitkit.storage.baselines import Arena, RankPosition, pack_local, read_share
from knitkit.storage.baselines.synthetic import synthetic_trajectories


def test_arena_reuses_one_buffer_after_the_first_round() -> None:
    """Takes are 64-byte aligned slices of one buffer; a round that needs more gets fresh arrays
    and the next reset grows the buffer, after which the same round allocates nothing."""
    arena = Arena()
    first = [arena.take(n) for n in (100, 7, 4096)]
    assert not any(np.shares_memory(a, b) for a in first for b in first if a is not b)
    arena.reset()
    second = [arena.take(n) for n in (100, 7, 4096)]
    base = second[0].base
    assert all(t.base is base for t in second) and arena.capacity >= 100 + 7 + 4096
    assert [t.ctypes.data % 64 for t in second] == [second[0].ctypes.data % 64] * 3
    arena.reset()
    assert arena.take(100).base is base


def test_sample_level_into_reused_buffers_equals_fresh_arrays() -> None:
    """read_share into an arena and pack_local into reused buffers give the same units and the
    same packed micro-batches as fresh allocations, step after step (nothing carried over)."""
    store = TrajectoryStore(MemoryBackend())
    trajectories = synthetic_trajectories(4, group_size=4, min_tokens=8, max_tokens=120)
    for t in trajectories:
        store.write(t)
    config = PlannerConfig(
        token_fields=("tokens", "logprobs", "routing"), max_tokens_per_micro_batch=64
    )
    raw, packed = Arena(), [Arena() for _ in range(3)]
    for step in range(2):
        metas = store.metas([t.trajectory_id for t in trajectories[step * 8 : (step + 1) * 8]])
        plan = plan_minibatch(metas, Topology(dp=2, cp=2), config)
        for rank in (RankPosition(0, 0, 0), RankPosition(1, 1, 0)):
            raw.reset()
            reused = read_share(store.backend, plan, rank, raw)
            fresh = read_share(store.backend, plan, rank)
            assert reused.units.keys() == fresh.units.keys()
            for key, unit in fresh.units.items():
                np.testing.assert_array_equal(reused.units[key], unit, err_msg=str(key))
            group = plan.consumer(rank.dp, rank.cp)
            for (layout, buffer), (want_layout, want) in zip(
                pack_local(group, reused, packed), pack_local(group, fresh), strict=True
            ):
                assert layout == want_layout
                views, want_views = layout.numpy_views(buffer), layout.numpy_views(want)
                for name, view in want_views.items():
                    np.testing.assert_array_equal(views[name], view, err_msg=name)
