"""A rank needs only the driver's RankSpec: plain JSON, round-tripped exactly, malformed text refused."""

from __future__ import annotations

import pytest
from job_harness import controller, driver_config, trajectories

from knitkit.job import RankCoords, RankSpec
from knitkit.storage import RingSpec, Topology


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


def test_ranks_on_several_nodes_read_their_nodes_schedule_ring_in_rank_order() -> None:
    """With ``nodes`` (a control plane that reaches several nodes), rank r reads the schedule ring
    of node ``nodes[r]`` at its place among that node's ranks, in rank order; the placement
    round-trips through JSON; a placement of some ranks only, or a node without a ring, is
    refused by name. Without ``nodes`` every rank reads ``schedule`` at its rank."""
    a, b = (RingSpec.new(num_slots=2, slot_bytes=4096, num_consumers=2) for _ in range(2))
    fields = {"topology": Topology(dp=2, tp=2), "pipeline": 1, "passes": (), "encoders": ()}
    spec = RankSpec(
        **fields,
        rings={},
        schedule=a,
        write_back={},
        nodes=("x", "y", "x", "y"),
        schedules={"x": a, "y": b},
    )
    assert [spec.schedule_of(r) for r in range(4)] == [(a, 0), (b, 0), (a, 1), (b, 1)]
    assert RankSpec.from_json(spec.to_json()) == spec
    one = RankSpec(**fields, rings={}, schedule=a, write_back={})
    assert one.schedule_of(3) == (a, 3)
    with pytest.raises(ValueError, match="names 2 ranks' nodes; the job has 4"):
        RankSpec(**fields, rings={}, schedule=a, write_back={}, nodes=("x", "y"), schedules={})
    with pytest.raises(ValueError, match=r"no schedule ring for nodes \['y'\]"):
        RankSpec(
            **fields,
            rings={},
            schedule=a,
            write_back={},
            nodes=("x", "y") * 2,
            schedules={"x": a},
        )
