"""``TrajectoryStore.metrics()``: flat ``knitkit/storage/...`` figures (issue 19's convention)."""

from __future__ import annotations

import numpy as np

from knitkit.storage import (
    MultimodalInput,
    SharedMemoryBackend,
    Trajectory,
    TrajectoryStore,
    UnitBackend,
)
from knitkit.types import UnitKey

FIGURES = {
    "knitkit/storage/bytes_read",
    "knitkit/storage/units_live",
    "knitkit/storage/bytes_live",
    "knitkit/storage/trajectories_live",
    "knitkit/storage/minibatches_registered",
    "knitkit/storage/deletes_deferred",
}


def _trajectory(tid: str, image: np.ndarray) -> Trajectory:
    return Trajectory(
        tid,
        "s0",
        {"tokens": np.arange(10, dtype=np.int32), "logprobs": np.zeros(10, np.float32)},
        {"reward": np.float32(1.0)},
        (MultimodalInput("image", image, 0, 2),),
    )


def test_metrics_follow_what_the_store_holds(local_backend: UnitBackend) -> None:
    """Units and bytes live count each unit once (a shared image once), trajectories live the
    index, bytes read the backend's reads; all plain floats under ``knitkit/storage/``; a
    shared-memory backend adds its /dev/shm and journal bytes."""
    store = TrajectoryStore(local_backend)
    image = np.ones((4, 8), dtype=np.float32)
    for tid in ("a", "b"):
        store.write(_trajectory(tid, image))
    figures = store.metrics()
    assert set(figures) >= FIGURES and all(type(v) is float for v in figures.values())
    assert all(k.startswith("knitkit/storage/") for k in figures)
    assert figures["knitkit/storage/trajectories_live"] == 2
    assert figures["knitkit/storage/units_live"] == 2 * 3 + 1
    assert figures["knitkit/storage/bytes_live"] == 2 * (40 + 40 + 4) + image.nbytes
    store.read(UnitKey("a", "tokens"), [(0, 4)])
    assert store.metrics()["knitkit/storage/bytes_read"] == 16
    store.release(["a"])
    after = store.metrics()
    assert after["knitkit/storage/units_live"] == 4
    assert after["knitkit/storage/trajectories_live"] == 1
    if isinstance(local_backend, SharedMemoryBackend):
        assert after["knitkit/storage/shm_bytes"] >= after["knitkit/storage/shm_used_bytes"] > 0
        assert after["knitkit/storage/journal_bytes"] > 0
    store.close()
