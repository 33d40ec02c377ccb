"""The handles across real processes: ranks spawned as a trainer's ranks are, the driver here."""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter

from job_harness import (
    controller,
    driver_config,
    grid,
    rank_process,
    token_ids,
    trajectories,
    wait_freed,
)


def test_spawned_ranks_train_every_pass_with_exact_write_back() -> None:
    """Two TP ranks of one group, each its own spawned process attached by ``RankSpec`` JSON
    alone: every admitted token once per pass on the group, both TP ranks bit-identical, the
    forward-only outputs read back bit-identical by the next pass, everything freed."""
    data = trajectories(2, 2, seed=11)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with driver_config(1, 1, 2, 1).build(admission=controller(data, 2)) as driver:
        spec = driver.rank_spec().to_json()
        ranks = [
            ctx.Process(target=rank_process, args=(spec, coords, results), daemon=True)
            for coords in grid(1, 1, 2, 1)
        ]
        for rank in ranks:
            rank.start()
        for trajectory in data:
            driver.write(trajectory)
        driver.finish()
        driver.drain(180)
        seen = sorted((results.get(timeout=120) for _ in ranks), key=lambda s: s.coords.rank)
        for rank in ranks:
            rank.join(60)
        wait_freed(driver.store)
    assert [s.error for s in seen if s.error] == []
    assert [m for s in seen for m in s.mismatches] == []
    assert seen[0].packed == seen[1].packed
    tokens = Counter(tok for key, toks in seen[0].tokens.items() if key[1] == "old" for tok in toks)
    assert tokens == Counter(tok for t in data for tok in token_ids(t))
    assert set(tokens.values()) == {1}
