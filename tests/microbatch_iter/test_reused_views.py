"""Field views built once per slot and layout, handed out again (NOTE [ Reused field views ]).

A slot that carries the same layout again gets the tensors it had before (no torch call, no GIL
hand-off in the prefetch thread), unless the training loop changed one of them in place; the
content is always the new micro-batch's, and a write into a ring slot's private view never
reaches the slot's next occupant.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.storage import MicroBatchConsumer, RingSpec
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import SlotRing
from knitkit.types import MicroBatchLayout

BOUND_S = 30.0


def test_a_repeated_layout_gets_its_slot_views_again_with_the_new_content(
    counting_source, expected_fields
):
    """Micro-batches i and i + depth + refill share a staging slot: with the same layout the
    second gets the first's tensor objects (a fresh dict), holding its own values."""
    depth, refill = 1, 2
    seen = []
    config = MicroBatchIterator.Config(depth=depth, refill=refill)
    with MicroBatchIterator(counting_source(8, (64,)), config, device="cpu") as it:
        for mb in it:
            for name, array in expected_fields(mb.index, 64).items():
                np.testing.assert_array_equal(mb[name].numpy(), array, err_msg=name)
            seen.append(mb)
    for earlier, later in zip(seen, seen[depth + refill :], strict=False):
        assert later.tensors is not earlier.tensors
        for name in later.tensors:
            assert later[name] is earlier[name], f"micro-batch {later.index}: {name} rebuilt"
        assert later.flat is earlier.flat


CHANGES = {
    "unsqueeze_": lambda mb: mb["tokens"].unsqueeze_(0),
    "requires_grad_": lambda mb: mb["logprobs"].requires_grad_(),
    "autograd history": lambda mb: mb["logprobs"].add_(torch.ones(64, requires_grad=True)),
    "transpose_": lambda mb: mb["routing"].transpose_(1, 2),
    "swapped .data": lambda mb: setattr(mb["tokens"], "data", mb["tokens"].clone()),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_views_the_loop_changed_in_place_are_built_again(change, counting_source, expected_fields):
    """A view the loop changed in place (reshaped, made require grad, given autograd history,
    transposed, its ``.data`` swapped) is not handed out again: the slot's next micro-batch gets
    fresh views of the layout's shapes, without autograd, over the slot."""
    seen = []
    config = MicroBatchIterator.Config(depth=1)
    with MicroBatchIterator(counting_source(6, (64,)), config, device="cpu") as it:
        for mb in it:
            assert mb["tokens"].shape == (64,) and mb["routing"].shape == (64, 2, 4)
            assert not any(t.requires_grad for t in mb.tensors.values())
            for name, array in expected_fields(mb.index, 64).items():
                np.testing.assert_array_equal(mb[name].numpy(), array, err_msg=name)
            seen.append(dict(mb.tensors))
            CHANGES[change](mb)
    for earlier, later in zip(seen, seen[2:], strict=False):
        assert all(later[name] is not earlier[name] for name in later)


@pytest.fixture
def ring() -> Iterator[tuple[RingSpec, Publisher]]:
    """A 2-slot ring for one consumer, and a started publisher."""
    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 16, num_consumers=1)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    yield spec, publisher
    publisher.close()
    owner.close()
    owner.unlink()


def test_reused_private_views_read_each_occupant_and_drop_the_loops_writes(ring):
    """CPU zero copy: micro-batches i and i + 2 occupy the same ring slot and share its views;
    each reads its own published values, never what the loop wrote into the previous occupant
    (the write stays in this process and is dropped at the release)."""
    spec, publisher = ring
    count = 8

    def produce() -> None:
        for value in range(count):
            layout = MicroBatchLayout.build({"x": ("int64", (4,))})
            layout.numpy_views(publisher.acquire(layout.nbytes))["x"][:] = value
            publisher.publish(layout)
        publisher.finish()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    seen = []
    consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=BOUND_S)
    with MicroBatchIterator(consumer, MicroBatchIterator.Config(depth=1), device="cpu") as it:
        for mb in it:
            assert mb["x"].tolist() == [mb.index] * 4
            mb["x"][:] = -1  # the loop writes into its micro-batch
            seen.append(mb["x"])
    producer.join(BOUND_S)
    assert len(seen) == count
    assert all(later is earlier for earlier, later in zip(seen, seen[2:], strict=False))
