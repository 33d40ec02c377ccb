"""The same Driver over Ray: ``RayDispatcher`` as its reorganizer pool, on a real local Ray cluster."""

from __future__ import annotations

from collections import Counter
from dataclasses import fields

import pytest
from job_harness import (
    controller,
    driver_config,
    grid,
    join,
    run_ranks,
    token_ids,
    trajectories,
    wait_freed,
)

from knitkit.job import Driver, ReorganizerFailedError
from knitkit.storage import EncoderTopology, Topology, TrajectoryStore

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'knitkit[ray]')")

from knitkit.integration.ray import RayBackend, RayDispatcher, RingConfig  # noqa: E402


def _pool(backend: RayBackend) -> RayDispatcher:
    return RayDispatcher(
        backend,
        Topology(dp=2),
        encoders=(EncoderTopology("vision", dp=1),),
        ring=RingConfig(slot_bytes=1 << 20),  # the default slots, as a user's pool gets them
    )


def test_ray_rings_default_to_the_slots_of_the_drivers_own_pool() -> None:
    """A ``RayDispatcher`` pool built with ``RingConfig``'s defaults gives each ring as many slots
    as the driver's own pool (the ranks' prefetch depth + 2): with fewer, a reorganizer
    publishes nothing of the next pass while the finished pass still holds its last leases
    (NOTE [ Data ring slots ] in knitkit/job/driver.py)."""
    driver_default = {f.name: f.default for f in fields(Driver.Config)}["num_slots"]
    assert RingConfig().num_slots == driver_default


def test_ray_actors_serve_the_driver_like_processes(local_ray: None) -> None:
    """Ray actors as the pool, a RayBackend as the store: every token once per pass, the
    forward-only outputs read back bit-identical, every unit freed; an actor killed mid-job
    fails the driver with ``ReorganizerFailedError`` naming its group."""
    backend = RayBackend()
    try:
        data = trajectories(2, 2, seed=12)
        config = driver_config(2, 1, 1, 1)
        store = TrajectoryStore(backend)
        with config.build(
            admission=controller(data, 2), store=store, pool=_pool(backend)
        ) as driver:
            threads, seen = run_ranks(driver.rank_spec(), grid(2, 1, 1, 1))
            for trajectory in data:
                driver.write(trajectory)
            driver.finish()
            driver.drain(120)
            join(threads)
            wait_freed(store)
        assert [s.error for s in seen if s.error] == []
        assert [m for s in seen for m in s.mismatches] == []
        for name in ("old", "train"):
            got = Counter(
                tok for s in seen for (_, p), toks in s.tokens.items() if p == name for tok in toks
            )
            assert got == Counter(tok for t in data for tok in token_ids(t)), name

        store = TrajectoryStore(backend)
        pool = _pool(backend)
        with config.build(admission=controller(data, 2), store=store, pool=pool) as driver:
            ray.kill(ray.get_actor(f"knitkit-reorganizer/{pool.rings['backbone/dp1/cp0'].name}"))
            with pytest.raises(ReorganizerFailedError, match="backbone/dp1/cp0"):
                for trajectory in data:  # a write may see the death first, or drain does
                    driver.write(trajectory)
                driver.drain(60)
    finally:
        backend.close()
