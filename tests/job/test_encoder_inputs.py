"""A rank reads its encoder inputs once per mini-batch (NOTE [ Encoder inputs once per
mini-batch ]): later encoding passes get the first pass's tensors at once, with no wait for
the encoder ring, and the ring stays in step with the schedule."""

from __future__ import annotations

import threading

import torch
from job_harness import controller, driver_config, join, trajectories, wait_freed

from knitkit.job import RankCoords, RankHandle, RankSpec
from knitkit.types import UnitKey


def test_later_encoding_passes_reuse_the_first_pass_inputs() -> None:
    """Both passes of each of two mini-batches encode: the second pass's inputs are the very
    tensors the first pass read (equal values, no second copy), a new mini-batch reads its own,
    and the driver drains (every encoder micro-batch was taken and released)."""
    data = trajectories(4, 2, seed=3)
    seen: dict[tuple[str, str], dict[UnitKey, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def rank(spec: RankSpec) -> None:
        try:
            with RankHandle(spec, RankCoords(0, 0, 0, 0, encoder_rank=0), device="cpu") as handle:
                for work in handle.passes():
                    with work:
                        seen[(work.minibatch_id, work.pass_.name)] = work.encoder_inputs()
                        for _ in work.micro_batches():
                            pass
                        if work.pass_.writes:
                            for i, mb in enumerate(work.consumer.micro_batches):
                                tokens = torch.zeros(mb.num_tokens)
                                work.write_back(i, {"old_lp": tokens})
        except BaseException as error:  # asserted below
            errors.append(error)

    with driver_config(1, 1, 1, 1).build(admission=controller(data, 2)) as driver:
        thread = threading.Thread(target=rank, args=(driver.rank_spec(),), daemon=True)
        thread.start()
        for trajectory in data:
            driver.write(trajectory)
        minibatches = driver.minibatches()
        driver.finish()
        driver.drain(120)
        join([thread])
        wait_freed(driver.store)
    assert not errors, errors[0]
    assert len(minibatches) == 2
    for mb in minibatches:
        old, train = seen[(mb, "old")], seen[(mb, "train")]
        assert old and list(old) == list(train)
        assert all(train[key] is old[key] for key in old), "the train pass copied its inputs again"
    first, second = (seen[(mb, "old")] for mb in minibatches)
    assert not set(first) & set(second) or all(
        first[k] is not second[k] for k in first if k in second
    )
