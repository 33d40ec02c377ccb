"""``TrajectoryStore.state_dict`` / ``load_state_dict``: the index as plain data, units on a durable
backend, resume after SIGKILL (issue 21, store part)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from knitkit.storage import (
    MemoryBackend,
    MultimodalInput,
    PlannerConfig,
    SafetensorsBackend,
    SharedMemoryBackend,
    Topology,
    Trajectory,
    TrajectoryStore,
    plan_minibatch,
)
from knitkit.storage.backends import UnitsLostError
from knitkit.types import UnitKey

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120
CONFIG = PlannerConfig(token_fields=("tokens", "logprobs"), scalar_fields=("reward",))


def make_trajectory(i: int) -> Trajectory:
    """Trajectory ``t<i>``: contents a pure function of ``i``; pairs share one image."""
    rng = np.random.default_rng(i)
    n = 5 + i % 7
    image = np.random.default_rng(i // 2).integers(0, 255, (4, 3), dtype=np.uint8)
    return Trajectory(
        f"t{i}",
        f"s{i // 2}",
        {
            "tokens": rng.integers(0, 1000, n).astype(np.int32),
            "logprobs": rng.standard_normal(n).astype(np.float32),
        },
        {"reward": np.float32(i / 10)},
        (MultimodalInput("image", image, 0, 2),),
        source="math" if i % 2 else "code",
        rollout_step=i // 4,
        min_version=i // 3,
        max_version=i // 3 + 1,
    )


def _state_roundtrip(state: dict) -> dict:
    """What a checkpoint file gives back: JSON only (no pickled bytes)."""
    return json.loads(json.dumps(state))


def test_a_store_rebuilt_over_the_same_directory_resumes_from_its_state(tmp_path: Path) -> None:
    """The state is plain JSON data; a new store over a new ``SafetensorsBackend`` of the same
    directory, loaded from it, has the same trajectories (metadata, units, schema), the same
    registered mini-batch with the same outstanding consumers, the same written-back progress,
    and reads every unit bit-identical; consuming the rest then frees everything as before."""
    directory = str(tmp_path / "shards")
    store = TrajectoryStore(SafetensorsBackend(directory, shard_bytes=1 << 12))
    for i in range(6):
        store.write(make_trajectory(i))
    store.declare_field("old_logprobs", "float32")
    store.write_ranges("t1", "old_logprobs", [(0, 2)], np.ones(2, np.float32))
    plan = store.register(
        plan_minibatch(store.metas(["t0", "t1", "t2", "t3"]), Topology(dp=2), CONFIG, (), "mb0")
    )
    store.consumed("mb0", plan.consumers[0].name)
    state = _state_roundtrip(store.state_dict())
    units = {k: store.read(k) for t in store.index.trajectory_ids() for k in store.index.units(t)}
    metas = store.metas()
    store.backend.close()  # the process "dies" here: nothing else is closed or deleted

    resumed = TrajectoryStore(SafetensorsBackend(directory, shard_bytes=1 << 12))
    result = resumed.load_state_dict(state)
    assert result.missing_units == () and result.deleted_units == ()
    assert resumed.metas() == metas
    assert resumed.outstanding("mb0") == (plan.consumers[1].name,)
    assert resumed.missing_ranges("t1", "old_logprobs") == ((2, 6),)
    assert resumed.schema("t1")["old_logprobs"] == ("float32", ())
    for key, array in units.items():
        got = resumed.read(key)
        assert got.dtype == array.dtype and got.tobytes() == array.tobytes(), key
    assert resumed.metrics()["knitkit/storage/units_live"] == len(units)
    resumed.consumed("mb0", plan.consumers[1].name)
    assert set(resumed.index.trajectory_ids()) == {"t4", "t5"}
    resumed.close()


def test_units_written_after_the_state_are_deleted_and_reported(tmp_path: Path) -> None:
    """A trajectory written after the state was taken is not in the resumed index: its units
    are deleted (so the re-issued trajectory can be written again) and named in the result."""
    directory = str(tmp_path / "shards")
    store = TrajectoryStore(SafetensorsBackend(directory))
    store.write(make_trajectory(0))
    state = _state_roundtrip(store.state_dict())
    store.write(make_trajectory(3))
    store.backend.flush()
    resumed = TrajectoryStore(SafetensorsBackend(directory))
    result = resumed.load_state_dict(state)
    assert {str(k) for k in result.deleted_units} >= {"t3/tokens", "t3/logprobs", "t3/reward"}
    resumed.write(make_trajectory(3))  # re-issued: no "already exists"
    assert resumed.index.trajectory_ids() == ("t0", "t3")
    resumed.close()


def test_a_restricted_state_keeps_just_the_named_trajectories_and_fields(tmp_path: Path) -> None:
    """``state_dict(trajectories=..., fields=...)`` (what a job driver keeps to resume): a store
    loaded from it holds exactly those trajectories with exactly those fields (their images
    too) and no registered mini-batch; every other unit of the directory (the others'
    trajectories, a written-back field, later writes) is deleted and named. Units it names
    outlive their frees like a whole state's. An unknown trajectory is refused by name."""
    directory = str(tmp_path / "shards")
    store = TrajectoryStore(SafetensorsBackend(directory))
    for i in range(4):
        store.write(make_trajectory(i))
    store.declare_field("old_logprobs", "float32")
    store.write_ranges("t2", "old_logprobs", [(0, 2)], np.ones(2, np.float32))
    store.register(plan_minibatch(store.metas(["t0", "t1"]), Topology(dp=1), CONFIG, (), "mb0"))
    with pytest.raises(KeyError, match="t9"):
        store.state_dict(trajectories=["t2", "t9"])
    kept = ("t2", "t3")
    state = _state_roundtrip(
        store.state_dict(trajectories=kept, fields=("tokens", "logprobs", "reward"))
    )
    assert state["minibatches"] == {}
    expected = {
        k: store.read(k) for t in kept for k in store.index.units(t) if k.field != "old_logprobs"
    }
    store.abort("mb0")
    store.release(["t2", "t3"])  # freed after the state: the named units wait (durable)
    store.backend.close()

    resumed = TrajectoryStore(SafetensorsBackend(directory))
    result = resumed.load_state_dict(state)
    assert result.missing_units == () and resumed.index.trajectory_ids() == kept
    deleted = set(result.deleted_units)
    assert UnitKey("t2", "old_logprobs") in deleted and not deleted & set(expected)
    assert set(resumed.index.units("t2")) | set(resumed.index.units("t3")) == set(expected)
    for key, array in expected.items():
        assert resumed.read(key).tobytes() == array.tobytes(), key
    resumed.close()


def test_units_freed_after_a_state_stay_until_two_newer_states(tmp_path: Path) -> None:
    """On a durable backend a unit the last two states name survives its free (the newest state
    may be mid-save when the process dies, the one before it then loads); it is deleted once
    two later states were taken; an image written again meanwhile is revived, not copied."""
    directory = str(tmp_path / "shards")
    store = TrajectoryStore(SafetensorsBackend(directory))
    for i in range(2):
        store.write(make_trajectory(i))
    first = _state_roundtrip(store.state_dict())
    store.release(["t0", "t1"])
    assert store.metrics()["knitkit/storage/deletes_deferred"] > 0
    kept = SafetensorsBackend(directory)
    assert UnitKey("t0", "tokens") in set(kept.keys())  # still on disk for `first`
    store.write(make_trajectory(1))  # the same image as t0's: revived
    store.state_dict()
    resumed = TrajectoryStore(SafetensorsBackend(directory))
    assert resumed.load_state_dict(first).missing_units == ()  # `first` still loads
    resumed.backend.close()
    store.state_dict()
    assert UnitKey("t0", "tokens") not in set(store.backend.keys())
    assert store.metrics()["knitkit/storage/deletes_deferred"] == 0
    np.testing.assert_array_equal(
        store.read(UnitKey("t1", "tokens")), make_trajectory(1).token_fields["tokens"]
    )
    store.close()


def test_a_reader_made_before_the_load_reads_a_trajectory_written_again(tmp_path: Path) -> None:
    """Issue 30.7: a resumed store's reader (a reorganizer's copy, pickled before
    ``load_state_dict``) reads a trajectory the state does not name, deleted by the load and
    written again under its id with new contents, as the new bytes: not 100..107 from the shard
    that still holds a unit the state names (NOTE [ Disk readers follow the owner ])."""
    directory = str(tmp_path / "shards")

    def late(start: int) -> Trajectory:
        tokens = np.arange(start, start + 8, dtype=np.int32)
        return Trajectory("late", "s-late", {"tokens": tokens, "logprobs": tokens / 2})

    store = TrajectoryStore(SafetensorsBackend(directory))
    store.write(make_trajectory(0))
    store.write(late(100))  # flushed into the same shard as t0's units
    state = _state_roundtrip(store.state_dict(trajectories=["t0"]))
    store.close()
    backend = SafetensorsBackend(directory)
    reader = pickle.loads(pickle.dumps(backend))
    resumed = TrajectoryStore(backend)
    assert UnitKey("late", "tokens") in resumed.load_state_dict(state).deleted_units
    resumed.write(late(900))
    backend.flush()
    np.testing.assert_array_equal(reader.read(UnitKey("late", "tokens")), np.arange(900, 908))
    np.testing.assert_array_equal(
        reader.read(UnitKey("t0", "tokens")), make_trajectory(0).token_fields["tokens"]
    )
    reader.close()
    resumed.close()


def test_a_fresh_store_over_a_killed_runs_directory_clears_it(tmp_path: Path) -> None:
    """Issue 30.12: a run killed after its first flush, before any checkpoint, leaves units in
    the directory; a fresh store over it (no state loaded) writes the same ids again instead of
    ``KeyError: unit t0/tokens already exists``, reads the new bytes, and holds none of the old
    units (NOTE [ A fresh store clears its backend ]: counted in ``units_cleared``)."""
    directory = str(tmp_path / "shards")
    killed = TrajectoryStore(SafetensorsBackend(directory))
    for i in range(3):
        killed.write(make_trajectory(i))
    killed.backend.flush()
    left = set(killed.backend.keys())
    killed.close()  # what a SIGKILL after the flush leaves: the shards

    store = TrajectoryStore(SafetensorsBackend(directory))
    tokens = np.arange(900, 905, dtype=np.int32)
    store.write(Trajectory("t0", "s0", {"tokens": tokens, "logprobs": tokens / 2}))
    np.testing.assert_array_equal(store.read(UnitKey("t0", "tokens")), tokens)
    assert set(store.backend.keys()) == {UnitKey("t0", "tokens"), UnitKey("t0", "logprobs")}
    assert store.metrics()["knitkit/storage/units_cleared"] == len(left)
    store.close()


@pytest.mark.parametrize("kind", ["shm", "memory"])
def test_a_state_over_memory_that_did_not_survive_names_the_missing_units(kind: str) -> None:
    """Shared memory (and memory) is not durable: loading a state into a store over a fresh such
    backend raises ``UnitsLostError`` naming the missing units and saying to re-write or
    re-issue them; ``strict=False`` leaves those trajectories (and the mini-batch planning
    them) out and names them."""

    def backend():
        return SharedMemoryBackend(slab_bytes=1 << 20) if kind == "shm" else MemoryBackend()

    store = TrajectoryStore(backend())
    for i in range(4):
        store.write(make_trajectory(i))
    store.register(plan_minibatch(store.metas(["t0", "t1"]), Topology(dp=1), CONFIG, (), "mb0"))
    state = _state_roundtrip(store.state_dict())
    store.close()
    fresh = TrajectoryStore(backend())
    with pytest.raises(UnitsLostError, match=r"not durable.*re-issue") as raised:
        fresh.load_state_dict(state)
    assert UnitKey("t0", "tokens") in raised.value.keys
    assert len(fresh.index) == 0
    result = fresh.load_state_dict(state, strict=False)
    assert result.dropped_trajectories == ("t0", "t1", "t2", "t3")
    assert result.dropped_minibatches == ("mb0",)
    assert len(fresh.index) == 0
    fresh.close()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda s: s.update(version=99),
        lambda s: s["trajectories"][0].update(num_tokens="5"),
        lambda s: s["trajectories"][0]["fields"].update(tokens="no-slash"),
        lambda s: s["minibatches"].update(mb9={"consumers": {}, "trajectories": ["ghost"]}),
        lambda s: s["trajectories"].append(s["trajectories"][0]),
    ],
)
def test_a_malformed_state_is_refused_before_anything_loads(tmp_path: Path, corrupt) -> None:
    """A state that is not what ``state_dict`` wrote raises ``ValueError`` naming what is wrong,
    and the store stays empty."""
    store = TrajectoryStore(SafetensorsBackend(str(tmp_path / "shards")))
    store.write(make_trajectory(0))
    state = _state_roundtrip(store.state_dict())
    corrupt(state)
    fresh = TrajectoryStore(SafetensorsBackend(str(tmp_path / "shards")))
    with pytest.raises(ValueError, match="state"):
        fresh.load_state_dict(state)
    assert len(fresh.index) == 0
    store.close()


_WRITER = """
import json, os, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_store_state import CONFIG, make_trajectory
from knitkit.storage import SafetensorsBackend, Topology, TrajectoryStore, plan_minibatch

directory, checkpoint = {directory!r}, {checkpoint!r}
# one unit per shard: a freed unit's file is unlinked at once (NOTE [ Units outlive their last state ])
store = TrajectoryStore(SafetensorsBackend(directory, shard_bytes=1))
store.declare_field("old_logprobs", "float32")
i = saves = 0
while True:
    for _ in range(4):
        store.write(make_trajectory(i))
        n = len(make_trajectory(i).token_fields["tokens"])
        store.write_ranges(f"t{{i}}", "old_logprobs", [(0, n // 2)], np.full(n // 2, i, np.float32))
        i += 1
    if i >= 8:  # train two trajectories of the previous stretch, which a saved state may name
        ids = [f"t{{i - 8}}", f"t{{i - 7}}"]
        mb = plan_minibatch(store.metas(ids), Topology(dp=1), CONFIG, (), f"mb{{i}}")
        plan = store.register(mb)
        store.consumed(f"mb{{i}}", plan.consumers[0].name)  # freed (deferred on disk)
        if saves == 3:  # trained units the last state names, wrote more: now die here
            print("trained", i, flush=True)
            sys.stdin.readline()
    if i % 8 == 0:
        state = store.state_dict()
        with open(checkpoint + ".tmp", "w") as f:  # a checkpoint save: temporary, then rename
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(checkpoint + ".tmp", checkpoint)
        saves += 1
        print("saved", saves, flush=True)
"""


def test_a_sigkilled_writer_resumes_from_its_last_state_bit_identical(tmp_path: Path) -> None:
    """A process writes trajectories (and written-back ranges) to a disk-backed store, trains and
    frees mini-batches, and saves a state every few steps; it is SIGKILLed mid-run. A fresh
    store over the same directory, loaded from the last saved state, reads every unit that state
    names bit-identical to what was written (units freed after the state included), keeps the
    written-back progress, and reports and deletes what was written after it."""
    directory = str(tmp_path / "shards")
    checkpoint = str(tmp_path / "store.json")
    code = _WRITER.format(
        tests=str(Path(__file__).parent), directory=directory, checkpoint=checkpoint
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert writer.stdout is not None
        lines = [writer.stdout.readline() for _ in range(4)]  # three saves, then more work
        assert lines[-1].startswith("trained"), (lines, writer.stderr and writer.stderr.read())
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(WAIT_S)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(WAIT_S)
    assert writer.returncode == -signal.SIGKILL
    with open(checkpoint) as f:
        state = json.load(f)

    resumed = TrajectoryStore(SafetensorsBackend(directory, shard_bytes=1))
    result = resumed.load_state_dict(state)
    assert result.missing_units == ()
    ids = resumed.index.trajectory_ids()
    assert ids
    for tid in ids:
        i = int(tid[1:])
        want = make_trajectory(i)
        for name, array in want.token_fields.items():
            got = resumed.read(UnitKey(tid, name))
            assert got.dtype == array.dtype and got.tobytes() == array.tobytes(), (tid, name)
        for name, value in want.scalars.items():
            assert resumed.read(UnitKey(tid, name)).tobytes() == np.asarray(value).tobytes()
        for image in want.multimodal:
            assert resumed.read(image.key).tobytes() == image.data.tobytes()
        n = len(want.token_fields["tokens"])
        assert resumed.missing_ranges(tid, "old_logprobs") == ((n // 2, n),)
        np.testing.assert_array_equal(
            resumed.read(UnitKey(tid, "old_logprobs"), [(0, n // 2)]), np.full(n // 2, i)
        )
    live = set(resumed.backend.keys())
    assert live == {k for t in ids for k in resumed.index.units(t)}
    resumed.close()
