"""Placement: a writer puts a trajectory's units, the store adopts its data-only record."""

from __future__ import annotations

import json

import numpy as np
import pytest

from knitkit.storage import (
    MemoryBackend,
    PlacedTrajectory,
    PlannerConfig,
    Topology,
    TrajectoryStore,
    UnitPlacer,
    plan_minibatch,
)
from knitkit.storage.baselines import synthetic_trajectories
from knitkit.types import UnitKey


def _sent(placed: PlacedTrajectory) -> PlacedTrajectory:
    """The record as a driver gets it: JSON text, parsed."""
    return PlacedTrajectory.from_dict(json.loads(json.dumps(placed.to_dict())))


def test_adopted_trajectories_index_and_plan_as_written_ones() -> None:
    """Placed then adopted (through JSON) the store holds what ``write`` holds: the same
    metadata, schema, unit bytes and plan; the shared image is placed once per group."""
    trajectories = synthetic_trajectories(2, group_size=2)
    written = TrajectoryStore(MemoryBackend())
    for trajectory in trajectories:
        written.write(trajectory)
    backend = MemoryBackend()
    adopted = TrajectoryStore(backend)
    records: list[PlacedTrajectory] = []
    placer = UnitPlacer(backend, records.append)
    metas = [placer.write(t) for t in trajectories]
    assert [adopted.adopt(_sent(p)) for p in records] == metas == written.metas()
    assert adopted.metrics() == written.metrics()
    assert sorted(backend.keys()) == sorted(written.backend.keys())
    topology = Topology(dp=1, cp=1, tp=1)
    assert plan_minibatch(adopted.metas(), topology, PlannerConfig()) == plan_minibatch(
        written.metas(), topology, PlannerConfig()
    )
    key = UnitKey(trajectories[0].trajectory_id, "routing")
    np.testing.assert_array_equal(backend.read(key), written.backend.read(key))


def test_adopt_refuses_units_the_backend_lacks_or_holds_otherwise() -> None:
    """A record naming a unit the backend does not hold is refused naming it (KeyError), a unit
    whose stored spec differs from the record's too (ValueError); nothing is indexed."""
    first, second = synthetic_trajectories(1, group_size=2)
    backend = MemoryBackend()
    store = TrajectoryStore(backend)
    placed = UnitPlacer(backend).place(first)
    backend.delete(UnitKey(first.trajectory_id, "logprobs"))
    with pytest.raises(KeyError, match=f"{first.trajectory_id}/logprobs"):
        store.adopt(placed)
    data = UnitPlacer(backend).place(second).to_dict()
    data["specs"][f"{second.trajectory_id}/tokens"][1][0] += 1
    with pytest.raises(ValueError, match=f"{second.trajectory_id}/tokens stored int"):
        store.adopt(PlacedTrajectory.from_dict(data))
    assert len(store.index) == 0


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (("specs", "s0-t0/tokens"), ["int64", [-1]]),
        (("specs", "s0-t0/reward"), ["object", []]),
        (("trajectory", "num_tokens"), "many"),
    ],
)
def test_a_malformed_record_is_refused_naming_the_entry(path: tuple[str, str], bad: object) -> None:
    """``from_dict`` parses what ``to_dict`` wrote and refuses anything else, naming it."""
    data = UnitPlacer(MemoryBackend()).place(synthetic_trajectories(1, group_size=1)[0]).to_dict()
    data[path[0]][path[1]] = bad
    with pytest.raises((ValueError, TypeError), match="placed trajectory record: "):
        PlacedTrajectory.from_dict(data)
