"""Store writes are validated whole before any state changes (issue 9, classes 3, 10); the
per-backend half of the shared validation runs in the contract suite (test_backend_contract.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.backends.disk import SafetensorsBackend
from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.units.payload import MultimodalInput, Trajectory
from knitkit.storage.units.store import TrajectoryStore
from knitkit.types import UnitKey


def _trajectory(tid: str = "t0", **fields: np.ndarray) -> Trajectory:
    token_fields = {"tokens": np.arange(6, dtype=np.int32), **fields}
    return Trajectory(tid, "s0", token_fields, {"reward": np.float32(1.0)})


BAD_TRAJECTORIES = [
    (lambda: _trajectory(""), ValueError, "trajectory id ''"),
    (lambda: _trajectory(**{"": np.zeros(6, np.float32)}), ValueError, "t0/"),
    (lambda: _trajectory(**{"lögprobs": np.zeros(6, np.float32)}), ValueError, "lögprobs"),
    (lambda: _trajectory(logprobs=np.zeros(6, np.complex128)), TypeError, "t0/logprobs"),
    (lambda: _trajectory(mask=np.array(["a"] * 6)), TypeError, "t0/mask"),
    (lambda: _trajectory(meta=np.array([None] * 6, dtype=object)), TypeError, "t0/meta"),
    (
        lambda: Trajectory(
            "t0",
            "s0",
            {"tokens": np.arange(6, dtype=np.int32)},
            multimodal=(MultimodalInput("image", np.zeros((4, 2), np.float32), 4, 4),),
        ),
        ValueError,
        r"t0.*multimodal input 0 .*\[4, 8\)",
    ),
]


@pytest.fixture(params=["memory", "shm", "disk"])
def store_dir(request: pytest.FixtureRequest, tmp_path: Path):
    directory = tmp_path / "shards"
    backend: UnitBackend = {
        "memory": MemoryBackend,
        "shm": lambda: SharedMemoryBackend(slab_bytes=1 << 20),
        "disk": lambda: SafetensorsBackend(str(directory), shard_bytes=1 << 20),
    }[request.param]()
    store = TrajectoryStore(backend)
    yield store, directory
    store.close()


@pytest.mark.parametrize("case", range(len(BAD_TRAJECTORIES)))
def test_a_bad_trajectory_leaves_the_store_and_directory_unchanged(store_dir, case: int) -> None:
    """``write`` validates every unit before any state changes: the error names the trajectory
    and field; the index, the backend and the shard directory are unchanged; later writes,
    ``close`` and a fresh reader of the directory all work (one bad write poisons nothing)."""
    store, directory = store_dir
    store.write(_trajectory("t-good"))
    if isinstance(store.backend, SafetensorsBackend):
        store.backend.flush()
    keys = sorted(store.backend.keys())
    files = sorted(os.listdir(directory)) if directory.exists() else []
    make, error, pattern = BAD_TRAJECTORIES[case]
    with pytest.raises(error, match=pattern):
        store.write(make())
    assert store.index.trajectory_ids() == ("t-good",)
    assert sorted(store.backend.keys()) == keys
    if isinstance(store.backend, SafetensorsBackend):
        store.backend.flush()
        assert sorted(os.listdir(directory)) == files
    store.write(_trajectory("t-later"))
    if isinstance(store.backend, SafetensorsBackend):
        store.backend.close()
        reader = SafetensorsBackend(str(directory))
        np.testing.assert_array_equal(reader.read(UnitKey("t-later", "tokens")), np.arange(6))
        reader.close()
