"""A write-back costs the training thread a few Python calls: its values are snapshotted there,
converted and queued off it (NOTE [ Write-backs converted off the loop ] in knitkit/job/work.py)."""

from __future__ import annotations

import torch
from call_count import python_calls
from job_harness import controller, driver_config, feed_one_rank, grid, output_of, trajectories

from knitkit.job import RankCoords, RankHandle, RankSpec
from knitkit.storage import PlannerConfig

HELD_CALLS = 8
"""Python frames a held write-back (not the pass's first) may enter on the training thread:
``write_back``, its token counts and snapshot (6 here); ee9a537 entered 20-24 (the conversion
to host rows, the copy, the record's queueing, the micro-batch's token count)."""


def _rank(spec: RankSpec, coords: RankCoords, out: dict[str, list[object]]) -> None:
    """Every pass; the writing pass writes each micro-batch back as ``[1, T]``, counting the
    frames, then overwrites its tensor; the reading pass compares what it reads."""
    try:
        with RankHandle(spec, coords, device="cpu") as rank:
            for work in rank.passes():
                with work:
                    work.encoder_inputs()
                    for i, mb in enumerate(work.micro_batches()):
                        real = mb["loss_mask"] > 0
                        if work.pass_.writes:
                            value = output_of(mb["tokens"])[None]
                            written = {"old_lp": value}
                            out["calls"].append(python_calls(lambda: work.write_back(i, written)))  # noqa: B023
                            value.fill_(-1.0)  # the record keeps what was written
                        elif not torch.equal(mb["old_lp"][real], output_of(mb["tokens"][real])):
                            out["mismatches"].append(f"{work.minibatch_id} micro-batch {i}")
    except BaseException as error:  # recorded for the test to assert on
        out["error"].append(f"{type(error).__name__}: {error}")


def test_a_held_write_back_enters_few_frames_and_reads_back_as_written() -> None:
    """One group, a writing pass of several micro-batches: its first write-back goes at once
    (the next pass reads it); every later one enters at most ``HELD_CALLS`` Python frames on
    the training thread, and the reading pass gets every written value bit for bit, though the
    caller overwrote its tensor after each write-back."""
    data = trajectories(3, 2, seed=43)
    config = driver_config(
        1, 1, 1, 1, num_slots=8, planner=PlannerConfig(max_tokens_per_micro_batch=256)
    )
    out: dict[str, list[object]] = {"calls": [], "mismatches": [], "error": []}
    with config.build(admission=controller(data, 1)) as driver:
        feed_one_rank(driver, data, lambda spec: _rank(spec, grid(1, 1, 1, 1)[0], out))
    assert out["error"] == [] and out["mismatches"] == [], out
    calls = out["calls"]
    assert len(calls) >= 3, calls  # held write-backs to count
    assert max(calls[1:]) <= HELD_CALLS, calls  # type: ignore[type-var]
