"""A collector applies every write-back record already published in one wake (NOTE [ A pass's records in one wake ] in collect.py)."""

from __future__ import annotations

import threading

from job_harness import controller, driver_config, output_of, trajectories, wait_for

from knitkit.job import RankCoords, RankHandle


def test_records_published_together_take_one_wake() -> None:
    """The driver's lock is held while a writer rank ends its forward-only pass, so its
    ``values`` records and its ``done`` all sit in the write-back ring (the rank's clean close
    waits until its pass-end thread published them). Once the lock is free, the collector
    applies them in at most two wakes (the one that took the first record before the lock was
    held, then all the rest): one per record before. Every record is applied exactly once."""
    data = trajectories(8, 2, seed=7)
    config = driver_config(1, 1, 1, 1, write_back_slots=16)
    with config.build(admission=controller(data, 1)) as driver:
        for trajectory in data:
            driver.write(trajectory)
        driver.finish()
        lock = driver._core.lock  # the one lock every driver thread applies records under
        written: list[int] = []
        handle = RankHandle(driver.rank_spec(), RankCoords(0, 0, 0, 0), device="cpu")
        work = handle.next_pass(timeout_s=120)
        assert work is not None and work.pass_.writes
        batches = list(work.micro_batches())  # the whole pass is delivered before the hold
        with lock:
            with work:
                for i, mb in enumerate(batches):
                    work.write_back(i, {"old_lp": output_of(mb["tokens"])})
                    written.append(i)
            closing = threading.Thread(target=handle.close, daemon=True)
            closing.start()
            closing.join(120)  # publishes every queued record; needs no driver lock
            assert not closing.is_alive(), "the rank's close never published its records"
        records = len(written) + 1  # one per micro-batch, and the pass's done
        assert records >= 3, f"the pass has {len(written)} micro-batches: too few to batch"

        def figures() -> dict[str, float]:
            return driver.metrics()

        wait_for(
            lambda: (
                figures()["knitkit/job/write_back_records"] == len(written)
                and figures()["knitkit/job/passes_consumed"] == 1
            ),
            60,
            "the pass's records applied",
        )
        got = figures()
        assert got["knitkit/job/write_back_records"] == len(written)  # each once
        assert 1 <= got["knitkit/job/write_back_wakes"] <= 2, got
