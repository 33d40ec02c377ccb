"""The driver's default data rings, and the GRPO example's, leave room past a pass's end (NOTE
[ Data ring slots ] in knitkit/job/driver.py)."""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path

import pytest
from job_harness import (
    controller,
    driver_config,
    feed_one_rank,
    trajectories,
    wait_for,
    wait_freed,
)

from knitkit.job import Driver, Pass, PassWork, RankCoords, RankHandle, RankSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from grpo.knit import DATA_RING_SLOTS, DEPTH

PASSES = (
    Pass("old", reads=("tokens",), forward_only=True),
    Pass("ref", reads=("tokens",), forward_only=True),
)
"""Two passes over rollout fields only: the second is served as soon as the first is."""


def _default(config: type, name: str) -> int:
    return next(f.default for f in dataclasses.fields(config) if f.name == name)


SETTINGS = {
    "example": (DEPTH, DATA_RING_SLOTS),
    "defaults": (_default(RankHandle.Config, "depth"), _default(Driver.Config, "num_slots")),
}
"""(prefetch depth, data ring slots): the example's, and the rank's and the driver's defaults."""


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_the_next_pass_arrives_while_the_pass_end_thread_has_not_closed_the_last(
    settings: tuple[int, int],
) -> None:
    """With these prefetch depth and ring slots, a rank whose pass-end thread has not yet closed
    a finished pass's iterator (which still holds that pass's last two leases) gets the next
    pass's first micro-batch all the same (with 2 slots it waits for that thread)."""
    depth, slots = settings
    data = trajectories(8, 2, seed=11)
    config = driver_config(1, 1, 1, 1, passes=PASSES, num_slots=slots)
    released, errors, firsts = threading.Event(), [], []

    def rank(spec: RankSpec) -> None:
        prefetch = RankHandle.Config(depth=depth, next_timeout_s=20.0)
        try:
            with RankHandle(spec, RankCoords(0, 0, 0, 0, encoder_rank=0), prefetch) as handle:
                for work in handle.passes():
                    with work:
                        if work.pass_.name == "ref":  # old's end is stalled (below)
                            batches = work.micro_batches()
                            firsts.append(next(batches))
                            released.set()
                            for _ in range(work.num_micro_batches - 1):
                                next(batches)
                            continue
                        _take_all_holding_two(work)
                        # the pass-end thread runs nothing after this until ref's first is in
                        handle._ends.post("stalled", lambda: released.wait(60.0) or None)
        except BaseException as error:
            errors.append(error)
        finally:
            released.set()

    with config.build(admission=controller(data, 1)) as driver:
        feed_one_rank(driver, data, rank)
        wait_freed(driver.store)
    assert not errors, errors
    assert len(firsts) == 1


def _take_all_holding_two(work: PassWork) -> None:
    """Every micro-batch, as megatron's schedule takes them (no extra ``next()``, which would
    close the iterator here), the prefetch thread ended before the last: so the pass's last two
    leases are both still held when the loop is done (the last, and the retired one before)."""
    batches = work.micro_batches()
    assert work.num_micro_batches >= 2
    for _ in range(work.num_micro_batches - 1):
        next(batches)
    prefetch = batches._prefetcher
    wait_for(lambda: not prefetch.alive(), 60, "the prefetch thread ended")
    next(batches)
