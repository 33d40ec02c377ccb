"""TrajectoryStore: atomic-unit writes, the hierarchical index, per-field updates, lifetimes."""

from __future__ import annotations

import numpy as np
import pytest

from knitkit.storage import (
    EncoderTopology,
    PlannerConfig,
    Topology,
    TrajectoryStore,
    UnitBackend,
    plan_minibatch,
)
from knitkit.storage.baselines.synthetic import synthetic_trajectories
from knitkit.storage.units.payload import MultimodalInput, Trajectory, video_groups
from knitkit.types import UnitKey

FIELDS = ("tokens", "logprobs", "loss_mask", "routing", "topp_mask")


def test_write_splits_fields_into_units_and_stores_a_shared_image_once(
    local_backend: UnitBackend,
) -> None:
    """One unit per field; the image of a GRPO sample is one content-addressed unit for all n."""
    backend = local_backend
    store = TrajectoryStore(backend)
    group = synthetic_trajectories(1, group_size=4, seed=1)
    metas = [store.write(t) for t in group]
    assert metas == [store.meta(t.trajectory_id) for t in group]
    entries = [store.entries(t.trajectory_id) for t in group]
    image_keys = {e.key for es in entries for e in es if e.key.field == "image"}
    assert len(image_keys) == 1
    image = next(iter(image_keys))
    assert sorted(backend.keys()).count(image) == 1
    assert len(list(backend.keys())) == 4 * (len(FIELDS) + 1) + 1
    assert store.index.sample("s0") == tuple(t.trajectory_id for t in group)
    assert store.index.referrers(image) == {t.trajectory_id for t in group}
    first = group[0]
    assert store.index.units(first.trajectory_id)[-1] == image
    meta = store.meta(first.trajectory_id)
    assert meta.num_tokens == first.num_tokens and meta.multimodal[0].key == image
    assert meta.multimodal[0].cost == 16.0
    routing = next(e for e in entries[0] if e.key.field == "routing")
    assert routing.per_token and routing.spec.shape == (first.num_tokens, 4, 2)
    schema = store.schema(first.trajectory_id)
    assert schema["routing"] == ("uint8", (4, 2)) and schema["reward"] == ("float32", ())


def test_video_groups_are_units_of_consecutive_frames(local_backend: UnitBackend) -> None:
    """A video becomes one unit per group of consecutive frames, placed at its token offsets."""
    backend = local_backend
    frames = np.arange(5 * 3 * 2, dtype=np.float32).reshape(5, 3, 2)
    groups = video_groups(frames, frames_per_group=2, token_start=10, tokens_per_frame=4)
    assert [g.data.shape[0] for g in groups] == [2, 2, 1]
    assert [(g.token_start, g.num_tokens) for g in groups] == [(10, 8), (18, 8), (26, 4)]
    store = TrajectoryStore(backend)
    tokens = np.arange(40, dtype=np.int64)
    store.write(Trajectory("v0", "sv", {"tokens": tokens}, multimodal=groups))
    keys = [ref.key for ref in store.meta("v0").multimodal]
    assert len(set(keys)) == 3 and all(k.field == "video" for k in keys)
    np.testing.assert_array_equal(store.read(keys[2]), frames[4:5])


def test_update_rewrites_exactly_one_unit(local_backend: UnitBackend) -> None:
    """update() changes only the named field's unit; a new field adds one unit."""
    backend = local_backend
    store = TrajectoryStore(backend)
    traj = synthetic_trajectories(1, group_size=1, seed=2)[0]
    store.write(traj)
    before = {k: backend.read(k).copy() for k in set(backend.keys())}
    new = np.zeros(traj.num_tokens, dtype=np.float32)
    entry = store.update(traj.trajectory_id, "logprobs", new)
    assert entry.key == UnitKey(traj.trajectory_id, "logprobs") and entry.per_token
    for key, old in before.items():
        want = new if key == entry.key else old
        np.testing.assert_array_equal(backend.read(key), want)
    added = store.update(traj.trajectory_id, "ref_logprobs", new + 1)
    assert added.per_token and set(backend.keys()) == {*before, added.key}


def test_bad_writes_and_updates_leave_the_store_unchanged(local_backend: UnitBackend) -> None:
    """Duplicate trajectory, malformed field, wrong dtype/shape update: errors name it; nothing changes."""
    backend = local_backend
    store = TrajectoryStore(backend)
    traj = synthetic_trajectories(1, group_size=1, seed=3)[0]
    store.write(traj)
    snapshot = {k: backend.read(k).copy() for k in set(backend.keys())}
    bad_length = Trajectory(
        "bad", "sb", {"tokens": np.arange(5), "logprobs": np.zeros(4, dtype=np.float32)}
    )
    cases = [
        (KeyError, traj.trajectory_id, lambda: store.write(traj)),
        (ValueError, "'logprobs'", lambda: store.write(bad_length)),
        (
            ValueError,
            f"{traj.trajectory_id}/logprobs",
            lambda: store.update(traj.trajectory_id, "logprobs", np.zeros(3, dtype=np.float32)),
        ),
        (
            ValueError,
            f"{traj.trajectory_id}/tokens",
            lambda: store.update(
                traj.trajectory_id, "tokens", traj.token_fields["tokens"].astype(np.int32)
            ),
        ),
        (KeyError, "nobody", lambda: store.update("nobody", "tokens", np.arange(3))),
        (
            IndexError,
            f"{traj.trajectory_id}/tokens",
            lambda: store.read(UnitKey(traj.trajectory_id, "tokens"), [(0, traj.num_tokens + 1)]),
        ),
    ]
    for error, name, call in cases:
        with pytest.raises(error, match=name):
            call()
    assert set(backend.keys()) == set(snapshot)
    for key, value in snapshot.items():
        np.testing.assert_array_equal(backend.read(key), value)
    assert store.index.trajectory_ids() == (traj.trajectory_id,)


def test_a_failed_backend_put_rolls_back_the_write(local_backend: UnitBackend) -> None:
    """A write that fails halfway (a unit key already taken in the backend, after the store's
    first write: NOTE [ A fresh store clears its backend ]) leaves no unit of it behind."""
    backend = local_backend
    store = TrajectoryStore(backend)
    first, traj = synthetic_trajectories(2, group_size=1, seed=4)
    store.write(first)
    before = set(backend.keys())
    backend.put(UnitKey(traj.trajectory_id, "routing"), np.zeros(3, dtype=np.uint8))
    with pytest.raises(KeyError, match="routing"):
        store.write(traj)
    assert set(backend.keys()) == before | {UnitKey(traj.trajectory_id, "routing")}
    assert store.index.trajectory_ids() == (first.trajectory_id,)


def test_nothing_leaks_across_train_batches(local_backend: UnitBackend) -> None:
    """Units go once every consumer of their mini-batch is done; filtered ones on release; none survive."""
    backend = local_backend
    store = TrajectoryStore(backend)
    config = PlannerConfig(token_fields=("tokens", "routing"), scalar_fields=("reward",))
    topology = Topology(dp=2, cp=2, tp=2)
    encoders = (EncoderTopology("vision", dp=2),)
    for train_batch in range(2):
        trajs = synthetic_trajectories(4, group_size=2, seed=10 + train_batch)
        for t in trajs:
            store.write(t)
        ids = [t.trajectory_id for t in trajs]
        filtered = ids[-2:]  # a zero-advantage group: counted, never trained on
        for m, part in enumerate((ids[0:4], ids[4:6])):
            plan = plan_minibatch(
                store.metas(part), topology, config, encoders, f"tb{train_batch}-mb{m}"
            )
            store.register(plan)
            consumers = [c.name for c in plan.consumers] + [r.name for r in plan.encoders[0].ranks]
            for name in consumers[:-1]:
                store.consumed(plan.minibatch_id, name)
            assert store.outstanding(plan.minibatch_id) == (consumers[-1],)
            assert any(k.owner in part for k in set(backend.keys()))
            store.consumed(plan.minibatch_id, consumers[-1])
            assert not any(k.owner in part for k in set(backend.keys()))
            with pytest.raises(KeyError, match="not registered"):
                store.consumed(plan.minibatch_id, consumers[-1])
        store.release(filtered)
        assert list(backend.keys()) == [] and len(store.index) == 0


def test_planned_trajectories_are_freed_by_consumers_or_abort(local_backend: UnitBackend) -> None:
    """release() refuses a planned trajectory (its consumers own it); abort() frees the mini-batch."""
    backend = local_backend
    store = TrajectoryStore(backend)
    for t in synthetic_trajectories(1, group_size=2, seed=6):
        store.write(t)
    plan = plan_minibatch(store.metas(), Topology(dp=2), minibatch_id="x")
    store.register(plan)
    with pytest.raises(ValueError, match="planned in mini-batch 'x'"):
        store.release(["s0-t0"])
    with pytest.raises(KeyError, match="already registered"):
        store.register(plan)
    store.consumed("x", "backbone/dp0/cp0")
    assert store.outstanding("x") == ("backbone/dp1/cp0",)
    store.abort("x")
    assert list(backend.keys()) == [] and len(store.index) == 0


def test_consumers_free_the_units_they_were_the_last_to_need(local_backend: UnitBackend) -> None:
    """A field read by both CP ranks survives the first consumer and goes with the second."""
    backend = local_backend
    store = TrajectoryStore(backend)
    traj = synthetic_trajectories(1, group_size=1, seed=5)[0]
    store.write(traj)
    config = PlannerConfig(token_fields=("tokens",), scalar_fields=())
    plan = plan_minibatch(store.metas(), Topology(dp=1, cp=2), config, minibatch_id="m")
    store.register(plan)
    tokens = UnitKey(traj.trajectory_id, "tokens")
    assert store.consumed("m", "backbone/dp0/cp0") == ()
    assert tokens in set(backend.keys())
    freed = store.consumed("m", "backbone/dp0/cp1")
    assert freed[0] == tokens and set(freed) == set(store_keys := freed)
    assert len(store_keys) == len(FIELDS) + 2 and list(backend.keys()) == []


def test_multimodal_payload_round_trips() -> None:
    """MultimodalInput keys are content hashes: equal data, equal key; different kind, different key."""
    data = np.ones((4, 3), dtype=np.float32)
    a = MultimodalInput("image", data, 0, 4)
    b = MultimodalInput("image", data.copy(), 5, 4)
    c = MultimodalInput("video", data, 0, 4)
    assert a.key == b.key and a.key != c.key and a.key.field == "image"
    assert MultimodalInput("image", data + 1, 0, 4).key != a.key
