"""The one write-back record a pass sends at once goes from the training thread, waking nobody, when nothing is queued before it; otherwise it waits its turn on the pass-end thread."""

from __future__ import annotations

import threading

import pytest
import torch
from job_harness import controller, driver_config, grid, join, output_of, trajectories

from knitkit.job import RankCoords, RankHandle, RankSpec
from knitkit.job.completion import PassEnds
from knitkit.job.records import RecordReader, RecordWriter
from knitkit.storage import PlannerConfig, RingSpec
from knitkit.storage.delivery import Producer


def _rank(spec: RankSpec, coords: RankCoords, out: dict[str, object]) -> None:
    """Every pass to the end. At the old pass's first write-back of each mini-batch: the
    pass-end thread idle first, then, from the second mini-batch on, a job the test holds
    queued on it; records the write-back ring's published count and the jobs posted, before
    and after the call."""
    mismatches: list[str] = []
    firsts: list[tuple[int, int, int, int]] = []
    try:
        with RankHandle(spec, coords, device="cpu") as rank:
            ends, ring = rank._ends, rank._writeback
            assert ring is not None
            for work in rank.passes():
                with work:
                    work.encoder_inputs()
                    for i, mb in enumerate(work.micro_batches()):
                        if not work.pass_.writes:
                            real = mb["loss_mask"] > 0
                            if not torch.equal(mb["old_lp"][real], output_of(mb["tokens"][real])):
                                mismatches.append(f"{work.minibatch_id} micro-batch {i}")
                            continue
                        release = threading.Event()
                        if i == 0:
                            ends.wait(timeout_s=60)  # nothing queued or running
                            before = (ring.published, ends.posted)
                            if firsts:
                                ends.post("held by the test", lambda e=release: e.wait(60) or None)
                        work.write_back(i, {"old_lp": output_of(mb["tokens"])})
                        if i == 0:
                            firsts.append((*before, ring.published, ends.posted))
                            release.set()
    except BaseException as error:  # recorded for the test to assert on
        out["error"] = f"{type(error).__name__}: {error}"
    out["mismatches"], out["firsts"] = mismatches, firsts


def test_the_first_write_back_is_published_by_the_training_thread_unless_jobs_are_queued() -> None:
    """A pass whose outputs the next pass reads: its first write-back record is in the ring
    when ``write_back`` returns and no job was posted for it (the pass-end thread was not
    woken: NOTE [ The first write-back from the training thread ] in rank.py); with a job
    queued before it, it is posted behind that job instead (published later, in order). Every
    record arrives once: the next pass reads every written value bit for bit."""
    data = trajectories(4, 2, seed=43)
    config = driver_config(
        1, 1, 1, 1, num_slots=8, planner=PlannerConfig(max_tokens_per_micro_batch=256)
    )
    seen: dict[str, object] = {}
    with config.build(admission=controller(data, 2)) as driver:
        thread = threading.Thread(
            target=_rank, args=(driver.rank_spec(), grid(1, 1, 1, 1)[0], seen), daemon=True
        )
        thread.start()
        for trajectory in data:
            driver.write(trajectory)
        driver.finish()
        driver.drain(120)
        join([thread])
    assert "error" not in seen, seen.get("error")
    # (published, jobs posted) before and after the first write-back
    idle, behind = seen["firsts"]  # type: ignore[misc]
    assert idle[2:] == (idle[0] + 1, idle[1]), idle  # published by the call, no job posted
    assert behind[2:] == (behind[0], behind[1] + 2), behind  # the test's job, then the record
    assert seen["mismatches"] == []


def test_try_send_never_blocks_on_a_full_ring() -> None:
    """``RecordWriter.try_send`` publishes while a slot is free and returns False, sending
    nothing, while every slot holds a record the reader has not released."""
    ring = RingSpec.new(num_slots=1, slot_bytes=1 << 12, num_consumers=1)
    writer = RecordWriter(ring, owns_ring=True, role="rank 3")
    reader = RecordReader(ring, 0, producer=Producer("rank 3", "test"), liveness_timeout_s=30)
    try:
        assert writer.try_send({"i": 0})
        assert not writer.try_send({"i": 1})
        assert writer.published == 1
        record = reader.next(10)
        assert record is not None and record.header == {"i": 0}
        assert writer.try_send({"i": 2})
        record = reader.next(10)
        assert record is not None and record.header == {"i": 2}
    finally:
        reader.close()
        writer.close()


def test_a_job_run_here_waits_its_turn_and_fails_as_the_thread_would() -> None:
    """``PassEnds.run_here`` runs nothing while a job is queued (held or not yet run); on an
    idle queue it runs the job on the calling thread; a job that raises raises there, is
    reported once (``on_failure``) and raised by every later hand-off."""
    failures: list[BaseException] = []
    ends = PassEnds(0, depth=8, timeout_s=10, on_failure=failures.append)
    ran: list[str] = []
    try:
        ends.post("a held record", lambda: ran.append("held"), now=False)
        assert not ends.run_here("a record", lambda: ran.append("here") or True)
        ends.wait(timeout_s=10)
        caller = threading.get_ident()
        assert ends.run_here(
            "a record", lambda: ran.append("here") or threading.get_ident() == caller
        )
        assert not ends.run_here("a record that would block", lambda: False)
        assert ran == ["held", "here"] and ends.posted == 1
        with pytest.raises(IndexError):
            ends.run_here("a failing record", lambda: bool([][0]))
        assert [type(f) for f in failures] == [IndexError]
        with pytest.raises(IndexError):
            ends.post("done record", lambda: None)
    finally:
        ends.stop(0.0)
        ends.join()
