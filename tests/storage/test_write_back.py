"""Write-back of per-token results by token range (issue 20, item 3): ``declare_field``,
``write_ranges``, ``field_complete`` on every local backend."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import numpy as np
import pytest

from knitkit.storage import (
    MemoryBackend,
    PlannerConfig,
    SafetensorsBackend,
    SharedMemoryBackend,
    Topology,
    Trajectory,
    TrajectoryStore,
    UnitBackend,
    pack,
    plan_minibatch,
)
from knitkit.types import UnitKey

N = 12


def _trajectory(tid: str, n: int = N) -> Trajectory:
    return Trajectory(tid, f"s-{tid}", {"tokens": np.arange(n, dtype=np.int32) + 100})


@pytest.fixture
def store(local_backend: UnitBackend) -> TrajectoryStore:
    made = TrajectoryStore(local_backend)
    made.write(_trajectory("a"))
    made.write(_trajectory("b", 5))
    made.declare_field("old_logprobs", "float32")
    made.declare_field("topk", "int64", (2,))
    return made


def test_ranged_writes_create_the_field_and_fill_it_piece_by_piece(store: TrajectoryStore) -> None:
    """The first write creates the unit (the trajectory's length, the declared dtype and row
    shape, zeros elsewhere); later writes move only their rows; the field is complete exactly
    when every token was written, in any order and with overlaps; other fields are untouched."""
    assert not store.field_complete("a", "old_logprobs")
    assert store.missing_ranges("a", "old_logprobs") == ((0, N),)
    store.write_ranges("a", "old_logprobs", [(4, 8)], np.full(4, 1.5, np.float32))
    want = np.zeros(N, np.float32)
    want[4:8] = 1.5
    np.testing.assert_array_equal(store.read(UnitKey("a", "old_logprobs")), want)
    assert store.missing_ranges("a", "old_logprobs") == ((0, 4), (8, N))
    store.write_ranges("a", "old_logprobs", [(10, N), (0, 5)], np.arange(7, dtype=np.float32))
    want[10:N], want[0:5] = [0, 1], [2, 3, 4, 5, 6]
    np.testing.assert_array_equal(store.read(UnitKey("a", "old_logprobs")), want)
    assert store.missing_ranges("a", "old_logprobs") == ((8, 10),)
    assert not store.field_complete("a", "old_logprobs")
    store.write_ranges("a", "old_logprobs", [(7, 10)], np.full(3, -1.0, np.float32))
    want[7:10] = -1.0
    assert store.field_complete("a", "old_logprobs")
    assert store.missing_ranges("a", "old_logprobs") == ()
    np.testing.assert_array_equal(store.read(UnitKey("a", "old_logprobs")), want)
    assert store.schema("a")["old_logprobs"] == ("float32", ())
    np.testing.assert_array_equal(store.read(UnitKey("a", "tokens")), np.arange(N) + 100)
    assert not store.field_complete("b", "old_logprobs")
    rows = np.arange(10, dtype=np.int64).reshape(5, 2)
    store.write_ranges("b", "topk", [(0, 5)], rows)
    assert store.field_complete("b", "topk")
    np.testing.assert_array_equal(store.read(UnitKey("b", "topk"), [(1, 3)]), rows[1:3])
    store.close()


def test_bad_write_backs_name_the_trajectory_and_field_and_change_nothing(
    store: TrajectoryStore,
) -> None:
    """Ranges outside the trajectory or overlapping, a wrong dtype (never cast) or row shape, a
    row count that does not match, an undeclared field, a scalar field or an unknown trajectory:
    each raises naming the trajectory and field; nothing is created or written."""
    store.write_ranges("a", "old_logprobs", [(0, 2)], np.ones(2, np.float32))
    before = store.read(UnitKey("a", "old_logprobs")).copy()
    cases = [
        (IndexError, "a", "old_logprobs", [(10, N + 1)], np.ones(3, np.float32)),
        (IndexError, "a", "old_logprobs", [(0, 3), (2, 4)], np.ones(5, np.float32)),
        (ValueError, "a", "old_logprobs", [(0, 2)], np.ones(2, np.float64)),
        (ValueError, "a", "old_logprobs", [(0, 2)], np.ones(3, np.float32)),
        (ValueError, "b", "topk", [(0, 2)], np.ones((2, 3), np.int64)),
        (IndexError, "b", "topk", [(0, 6)], np.ones((6, 2), np.int64)),
        (KeyError, "a", "never_declared", [(0, 1)], np.ones(1, np.float32)),
    ]
    for error, tid, field, ranges, values in cases:
        with pytest.raises(error, match=rf"{tid}.*{field}|{field}.*{tid}"):
            store.write_ranges(tid, field, ranges, values)
    with pytest.raises(KeyError, match="'nobody'"):
        store.write_ranges("nobody", "old_logprobs", [(0, 1)], np.ones(1, np.float32))
    np.testing.assert_array_equal(store.read(UnitKey("a", "old_logprobs")), before)
    assert "topk" not in store.schema("b")
    store.update("a", "reward", np.float32(1.0))
    with pytest.raises(ValueError, match=r"'a'.*'reward'"):
        store.write_ranges("a", "reward", [(0, 1)], np.ones(1, np.float32))
    with pytest.raises(ValueError, match="'old_logprobs'"):
        store.declare_field("old_logprobs", "float16")
    store.close()


def test_a_stored_per_token_field_can_be_rewritten_by_ranges(store: TrajectoryStore) -> None:
    """A field written with the trajectory (complete) takes ranged writes too and stays
    complete; ``update`` of a partly written field makes it complete."""
    store.declare_field("tokens", "int32")
    store.write_ranges("a", "tokens", [(1, 3)], np.array([7, 8], np.int32))
    assert store.field_complete("a", "tokens")
    assert store.read(UnitKey("a", "tokens"))[:4].tolist() == [100, 7, 8, 103]
    store.write_ranges("b", "old_logprobs", [(0, 1)], np.ones(1, np.float32))
    store.update("b", "old_logprobs", np.arange(5, dtype=np.float32))
    assert store.field_complete("b", "old_logprobs")
    store.close()


def _read_in_child(blob: bytes, key: UnitKey, conn) -> None:
    reader = pickle.loads(blob)
    conn.send(reader.read(key).tolist())
    reader.close()


@pytest.mark.parametrize("kind", ["shm", "disk"])
def test_written_back_rows_reach_readers_in_other_processes(kind: str, tmp_path) -> None:
    """What a pass writes back is what a reorganizer in another process reads (shared memory at
    once; disk once flushed), and a plan packing the field delivers it."""
    backend: UnitBackend = (
        SharedMemoryBackend(slab_bytes=1 << 20)
        if kind == "shm"
        else SafetensorsBackend(str(tmp_path / "shards"))
    )
    store = TrajectoryStore(backend)
    store.write(_trajectory("a"))
    store.declare_field("old_logprobs", "float32")
    store.write_ranges("a", "old_logprobs", [(0, N)], np.arange(N, dtype=np.float32))
    backend.flush()
    store.write_ranges("a", "old_logprobs", [(3, 5)], np.array([-3, -4], np.float32))
    backend.flush()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    key = UnitKey("a", "old_logprobs")
    process = ctx.Process(target=_read_in_child, args=(pickle.dumps(backend), key, child))
    process.start()
    process.join(120)
    want = [0.0, 1.0, 2.0, -3.0, -4.0, *map(float, range(5, N))]
    assert process.exitcode == 0 and parent.recv() == want
    config = PlannerConfig(token_fields=("tokens", "old_logprobs"), scalar_fields=())
    plan = store.register(plan_minibatch(store.metas(), Topology(dp=1), config, (), "mb0"))
    layout, buffer = pack(
        plan.consumer(0, 0).micro_batches[0], plan.consumer(0, 0).row_specs, store.read_into
    )
    assert layout.numpy_views(buffer)["old_logprobs"][:N].tolist() == want
    store.close()


def test_a_backend_with_whole_unit_replace_only_gets_the_default(tmp_path) -> None:
    """A backend that does not override ``write_ranges`` inherits the Protocol's default (read,
    paste, replace) with the same result and errors."""

    class ReplaceOnly(MemoryBackend):
        write_ranges = UnitBackend.write_ranges

    store = TrajectoryStore(ReplaceOnly())
    store.write(_trajectory("a"))
    store.declare_field("old_logprobs", "float32")
    store.write_ranges("a", "old_logprobs", [(0, 2)], np.ones(2, np.float32))
    store.write_ranges("a", "old_logprobs", [(5, 6)], np.full(1, 2.0, np.float32))
    assert store.read(UnitKey("a", "old_logprobs"))[:7].tolist() == [1, 1, 0, 0, 0, 2, 0]
    with pytest.raises(IndexError, match="a/old_logprobs"):
        store.write_ranges("a", "old_logprobs", [(11, 13)], np.ones(2, np.float32))
    store.close()
