"""Passes served from one plan: exactly once per pass on every topology, write-back exact."""

from __future__ import annotations

from collections import Counter

import pytest
from job_harness import (
    PASSES,
    controller,
    driver_config,
    grid,
    join,
    run_ranks,
    token_ids,
    trajectories,
    wait_freed,
)

from knitkit.storage import content_key

TOPOLOGIES = [
    pytest.param(2, 2, 1, 2, 4, 4, id="dp2-cp2-encoder2"),
    pytest.param(3, 1, 2, 3, 3, 4, id="dp3-tp2-encoder3"),
    pytest.param(4, 2, 1, 3, 1, 3, id="dp4-cp2-idle-ranks"),
]


@pytest.mark.parametrize(("dp", "cp", "tp", "encoder_dp", "samples", "group"), TOPOLOGIES)
def test_every_token_reaches_one_consumer_once_per_pass(
    dp: int, cp: int, tp: int, encoder_dp: int, samples: int, group: int
) -> None:
    """Invariants, per mini-batch and per pass: every admitted token reaches exactly one (DP, CP)
    group once; TP peers get bit-identical micro-batches; every unique image reaches exactly one
    encoder rank once per pass that encodes, and the reorganizers read exactly what the passes
    consume (each image once per mini-batch, served with its first encoding pass); the
    forward-only pass's outputs come back to the next pass bit-identical at every real token;
    every unit is freed after the last pass. Idle ranks (more DP ranks than trajectories) take
    part with empty micro-batches."""
    data = trajectories(samples, group, seed=dp * 10 + cp)
    by_id = {t.trajectory_id: t for t in data}
    config = driver_config(dp, cp, tp, encoder_dp)
    with config.build(admission=controller(data, 2)) as driver:
        threads, seen = run_ranks(driver.rank_spec(), grid(dp, cp, tp, encoder_dp))
        admitted = {}
        for trajectory in data:
            driver.write(trajectory)
        for minibatch_id in driver.minibatches():
            admitted[minibatch_id] = driver.ledger(minibatch_id).trajectories
        driver.finish()
        driver.drain(120)
        join(threads)
        read = driver.metrics()["knitkit/delivery/reorganizer_bytes_read"]
        wait_freed(driver.store)
    errors = [s.error for s in seen if s.error]
    assert not errors, errors[0]
    assert [m for s in seen for m in s.mismatches] == []
    assert len(admitted) == 2
    for minibatch_id, ids in admitted.items():
        expected = Counter(tok for tid in ids for tok in token_ids(by_id[tid]))
        images = Counter(str(content_key("image", by_id[tid].multimodal[0].data)) for tid in ids)
        for p in PASSES:
            key = (minibatch_id, p.name)
            got = Counter(tok for s in seen if s.coords.tp == 0 for tok in s.tokens[key])
            assert got == expected and set(got.values()) == {1}, (key, got - expected)
            units = Counter(u for s in seen for u in s.units[key])
            assert units == Counter(dict.fromkeys(images, 1)), key
            for s in seen:
                peer = next(
                    o
                    for o in seen
                    if (o.coords.dp, o.coords.cp, o.coords.tp) == (s.coords.dp, s.coords.cp, 0)
                )
                assert s.packed[key] == peer.packed[key], (key, s.coords)
    # bytes: tokens (int64) in both passes, old_lp (float32) and reward (float32, on every CP
    # rank of its DP rank) in the second, each mini-batch's unique images once (both passes
    # encode, the units are served with the first; a GRPO group split over two mini-batches is
    # encoded in each)
    tokens = sum(len(token_ids(t)) for t in data)
    image_bytes = sum(
        len({content_key("image", by_id[t].multimodal[0].data) for t in ids})
        * data[0].multimodal[0].data.nbytes
        for ids in admitted.values()
    )
    assert read == 2 * 8 * tokens + 4 * tokens + 4 * cp * len(data) + image_bytes
