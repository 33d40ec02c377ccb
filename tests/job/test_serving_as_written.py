"""A pass that reads written fields is served micro-batch by micro-batch, as their write-backs arrive."""

from __future__ import annotations

import threading

import torch
from job_harness import (
    controller,
    driver_config,
    grid,
    join,
    output_of,
    trajectories,
    wait_for,
)

from knitkit.job import Driver, RankCoords, RankHandle, RankSpec
from knitkit.storage import PlannerConfig

GROUP = "backbone/dp0/cp0"


def _published(driver: Driver) -> float:
    return driver.metrics()["knitkit/delivery/reorganizer_published"]


def _rank(
    spec: RankSpec, coords: RankCoords, during_first_old: threading.Event, out: dict[str, object]
) -> None:
    """Every pass to the end; inside the old pass's first micro-batch, after writing it back,
    waits for ``during_first_old`` (the test's checks) before it goes on."""
    tokens: dict[str, list[int]] = {}
    mismatches = []
    try:
        with RankHandle(spec, coords, device="cpu") as rank:
            for work in rank.passes():
                out.setdefault("counts", {})[work.pass_.name] = work.num_micro_batches  # type: ignore[index]
                with work:
                    work.encoder_inputs()
                    for i, mb in enumerate(work.micro_batches()):
                        real = mb["loss_mask"] > 0
                        tokens.setdefault(work.pass_.name, []).extend(mb["tokens"][real].tolist())
                        if work.pass_.writes:
                            work.write_back(i, {"old_lp": output_of(mb["tokens"])})
                            if i == 0:
                                out["reached"] = True
                                assert during_first_old.wait(120), "the test never released"
                        elif not torch.equal(mb["old_lp"][real], output_of(mb["tokens"][real])):
                            mismatches.append(f"{work.pass_.name} micro-batch {i}")
    except BaseException as error:  # recorded for the test to assert on
        out["error"] = f"{type(error).__name__}: {error}"
    out["tokens"], out["mismatches"] = tokens, mismatches


def test_a_pass_gets_its_first_micro_batch_while_the_writer_pass_still_runs() -> None:
    """One group, the forward-only pass in several micro-batches: once the rank wrote back its
    first one (and holds it, the rest untouched), the reading pass's first micro-batch is served
    and published (its reads are in) while the writer pass still runs; its later micro-batches
    only as their write-backs come. Every token is read once per pass and the written field
    reads back bit for bit."""
    data = trajectories(3, 2, seed=41)
    config = driver_config(
        1, 1, 1, 1, num_slots=8, planner=PlannerConfig(max_tokens_per_micro_batch=256)
    )
    release, seen = threading.Event(), {}
    with config.build(admission=controller(data, 1)) as driver:
        coords = grid(1, 1, 1, 1)[0]
        thread = threading.Thread(
            target=_rank, args=(driver.rank_spec(), coords, release, seen), daemon=True
        )
        thread.start()
        for trajectory in data:
            driver.write(trajectory)
        driver.finish()
        try:
            wait_for(lambda: "reached" in seen or "error" in seen, 60, "the first old write-back")
            plan = driver.ledger("tb0-mb0").plan
            old = len(plan.consumer(0, 0).micro_batches)
            units = len(plan.encoders[0].ranks[0].micro_batches)
            assert old >= 2 and old + 1 <= config.num_slots, old  # room for train's first
            wait_for(lambda: _published(driver) >= old + units + 1, 60, "train's first micro-batch")
            ledger = driver.ledger("tb0-mb0").passes["train"]
            assert ledger.started == {GROUP} and ledger.submitted == set(), ledger
            assert _published(driver) == old + units + 1  # the rest waits for its write-backs
            assert not driver.consumed("tb0-mb0", "old")
        finally:
            release.set()
        driver.drain(120)
        join([thread])
    assert "error" not in seen, seen.get("error")
    assert seen["counts"] == {"old": old, "train": old}
    assert seen["mismatches"] == []
    for name in ("old", "train"):
        whole = sorted(t for tr in data for t in tr.token_fields["tokens"].tolist())
        assert sorted(seen["tokens"][name]) == whole, name  # type: ignore[index]
