"""A rank needs only the driver's RankSpec: plain JSON, round-tripped exactly, malformed text refused."""

from __future__ import annotations

import pytest
from job_harness import controller, driver_config, trajectories

from knitkit.job import RankCoords, RankSpec


def test_rank_spec_round_trips_through_json() -> None:
    """``RankSpec.from_json(spec.to_json()) == spec`` for a real driver's spec (rings, passes,
    encoders, timeouts, extra values), and the text is data only (no code, no pickle)."""
    data = trajectories(1, 2, seed=0)
    with driver_config(2, 2, 2, 3).build(admission=controller(data, 1)) as driver:
        spec = driver.rank_spec(seed=7, note="x")
    text = spec.to_json()
    assert RankSpec.from_json(text) == spec
    assert RankSpec.from_json(text.encode()) == spec
    assert spec.world_size == 8 and set(spec.write_back) == {
        f"backbone/dp{d}/cp{c}" for d in range(2) for c in range(2)
    }
    assert {n for n in spec.rings if n.startswith("vision/")} == {f"vision/dp{r}" for r in range(3)}


def test_malformed_specs_and_coordinates_are_refused_by_name() -> None:
    """Text that is not a spec, or coordinates outside the job, raise ``ValueError`` naming what."""
    with pytest.raises(ValueError, match="not a RankSpec"):
        RankSpec.from_json('{"topology": {"dp": 1}}')
    with pytest.raises(ValueError, match="not a RankSpec"):
        RankSpec.from_json("[1, 2")
    data = trajectories(1, 2, seed=0)
    with driver_config(2, 1, 1, 1).build(admission=controller(data, 1)) as driver:
        spec = driver.rank_spec()
    with pytest.raises(ValueError, match=r"RankCoords.dp=2 outside \[0, 2\)"):
        RankCoords(rank=0, dp=2).check(spec)
    with pytest.raises(ValueError, match="encoder_rank=1 outside encoder 'vision'"):
        RankCoords(rank=0, dp=0, encoder_rank=1).check(spec)
