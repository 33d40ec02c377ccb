"""Production gating and consumption tracking: a pass waits for its reads; units live until the last pass."""

from __future__ import annotations

from collections.abc import Mapping

from job_harness import (
    Hold,
    controller,
    driver_config,
    grid,
    join,
    run_ranks,
    trajectories,
    wait_for,
    wait_freed,
)


def test_a_pass_is_served_only_after_its_reads_are_produced() -> None:
    """The train pass reads what the forward-only pass writes: while a rank holds back its
    outputs, the scheduler does not serve the train pass (the field is not produced, the pass
    is not consumed, the progress says what it waits for); once the outputs arrive it is."""
    data = trajectories(2, 2, seed=5)
    hold = Hold("tb0-mb0", "old")
    with driver_config(2, 1, 1, 1).build(admission=controller(data, 2)) as driver:
        threads, seen = run_ranks(driver.rank_spec(), grid(2, 1, 1, 1), hold=hold)
        for trajectory in data:
            driver.write(trajectory)
        driver.finish()
        assert hold.reached.wait(60)
        wait_for(lambda: "tb0-mb0/train waits for old_lp" in driver.progress().blocked)
        progress = driver.progress()
        assert progress.served == {"old": 1, "train": 0}, progress
        assert driver.produced("tb0-mb0", "tokens") and not driver.produced("tb0-mb0", "old_lp")
        assert not driver.consumed("tb0-mb0", "old")
        hold.release.set()
        driver.drain(120)
        join(threads)
        assert driver.progress().served == {"old": 2, "train": 2}
        assert driver.produced("tb0-mb0", "old_lp") and driver.progress().blocked == ""
    assert [s.error for s in seen if s.error] == []
    assert [m for s in seen for m in s.mismatches] == []


def test_consumption_is_tracked_per_pass_and_units_live_until_the_last_pass() -> None:
    """``consumed`` / ``consumers`` follow each group's end of each pass; a mini-batch's units
    (its rollout fields and the written-back outputs) stay in the store between its passes and
    are all freed after its last pass; the observer gets one step per released mini-batch."""
    data = trajectories(2, 2, seed=6)
    hold = Hold("tb0-mb0", "train")
    observed: list[tuple[int, dict[str, float]]] = []

    def observe(step: int, figures: Mapping[str, float]) -> None:
        observed.append((step, dict(figures)))

    config = driver_config(2, 1, 1, 1)
    with config.build(admission=controller(data, 2), observe=observe) as driver:
        threads, seen = run_ranks(driver.rank_spec(), grid(2, 1, 1, 1), hold=hold)
        for trajectory in data:
            driver.write(trajectory)
        driver.finish()
        assert hold.reached.wait(60)
        wait_for(lambda: driver.consumed("tb0-mb0", "old"))
        assert driver.consumers("tb0-mb0", "old") == ("backbone/dp0/cp0", "backbone/dp1/cp0")
        assert not driver.consumed("tb0-mb0", "train")
        assert driver.consumers("tb0-mb0", "train") == ()
        ids = driver.ledger("tb0-mb0").trajectories
        assert all(driver.store.field_complete(t, "old_lp") for t in ids)
        assert all(driver.store.field_complete(t, "tokens") for t in ids)
        hold.release.set()
        driver.drain(120)
        join(threads)
        assert driver.consumed("tb0-mb0", "train") and driver.consumed("tb0-mb1", "train")
        wait_freed(driver.store)
        assert driver.progress().released == 2
    assert [s.error for s in seen if s.error] == []
    assert [step for step, _ in observed] == [1, 2]
    assert [f["knitkit/job/minibatches_released"] for _, f in observed] == [1.0, 2.0]
    assert all(f["knitkit/delivery/reorganizer_bytes_read"] > 0 for _, f in observed)
