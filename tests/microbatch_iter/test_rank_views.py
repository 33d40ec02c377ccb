"""A slot whose every micro-batch has a layout of its own (packed token counts vary) builds each
one's field views with one torch call per field: the slot's views per dtype are made once
(issue 31; NOTE [ Reused field views ] in knitkit/microbatch_iter/batch.py), and an inline
hand-out keeps one tensor per ring slot (NOTE [ Slot tensors kept ] in
knitkit/microbatch_iter/worker.py)."""

from __future__ import annotations

import collections
import threading

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.microbatch_iter.batch import ViewCache
from knitkit.storage import MicroBatchConsumer, RingSpec
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import SlotRing
from knitkit.types import MicroBatchLayout

_MAKES_A_TENSOR = {"as_strided", "view", "__getitem__", "narrow", "reshape", "frombuffer"}
BOUND_S = 60.0


def _layout(tokens: int) -> MicroBatchLayout:
    return MicroBatchLayout.build(
        {
            "tokens": ("int64", (tokens,)),
            "position_ids": ("int64", (tokens,)),
            "loss_mask": ("float32", (tokens,)),
            "logprobs": ("float32", (tokens,)),
            "cu_seqlens": ("int32", (9,)),
            "routing": ("uint8", (tokens, 2, 4)),
        }
    )


class _Counted(TorchFunctionMode):
    """Counts the torch calls that make a tensor, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in _MAKES_A_TENSOR:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def test_new_layouts_over_one_slot_cost_one_torch_call_per_field() -> None:
    """Eight layouts in a row over one buffer, each new: after the first build, each build makes
    one view per field and the micro-batch's flat slice, nothing per dtype; every view reads
    its field's bytes."""
    slot = torch.zeros(1 << 16, dtype=torch.uint8)
    views = ViewCache()
    views.put(slot, _layout(100), {})
    for tokens in range(101, 109):
        layout = _layout(tokens)
        assert views.get(layout, {}) is None
        with _Counted() as counted:
            flat, tensors = views.put(slot, layout, {})
        assert sum(counted.calls.values()) <= len(layout.fields) + 1, counted.calls
        assert flat.numel() == layout.nbytes
        for view in layout.fields:
            tensor = tensors[view.name]
            assert tuple(tensor.shape) == view.shape
            assert tensor.data_ptr() == slot.data_ptr() + view.offset


def test_autograd_on_one_layouts_view_reaches_no_later_layouts_views() -> None:
    """The loop adds a tensor that requires grad into a view in place (autograd rebases the
    view's history onto the dtype view it was cut from): the slot's next micro-batch, of
    another layout, still gets views without autograd, over the slot."""
    slot = torch.zeros(1 << 16, dtype=torch.uint8)
    views = ViewCache()
    _, tensors = views.put(slot, _layout(64), {})
    tensors["logprobs"].add_(torch.ones(64, requires_grad=True))
    layout = _layout(65)
    _, later = views.put(slot, layout, {})
    assert not any(tensor.requires_grad for tensor in later.values())
    assert later["logprobs"].data_ptr() == slot.data_ptr() + layout.field("logprobs").offset


def test_an_inline_hand_out_cuts_growing_micro_batches_from_one_tensor_per_slot() -> None:
    """Over a real 2-slot ring, each micro-batch larger than the last (so larger than its slot's
    last occupant): after each slot's first hand-out, a ``next()`` makes one view per field and
    the flat slice, no tensor over the buffer and no view per dtype; every field reads its
    published bytes (on 058d322: a ``frombuffer`` and three dtype views more per hand-out)."""
    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 16, num_consumers=1)
    layouts = [_layout(100 + 7 * i) for i in range(10)]
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()

    def produce() -> None:
        for i, layout in enumerate(layouts):
            np.frombuffer(publisher.acquire(layout.nbytes), np.uint8)[:] = i + 1
            publisher.publish(layout)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=BOUND_S)
    made = []
    try:
        config = MicroBatchIterator.Config(depth=1, next_timeout_s=BOUND_S)
        with MicroBatchIterator(consumer.take(len(layouts)), config, device="cpu") as it:
            for i, layout in enumerate(layouts):
                with _Counted() as counted:
                    mb = next(it)
                made.append(counted.calls)
                assert mb.layout == layout
                assert mb.flat.numel() == layout.nbytes
                assert bool((mb["routing"] == i + 1).all()) and bool((mb["tokens"] != 0).all())
    finally:
        consumer.close()
        producer.join(BOUND_S)
        publisher.close()
        owner.close()
        owner.unlink()
    for calls, layout in zip(made[2:], layouts[2:], strict=True):  # each slot's first: set-up
        assert sum(calls.values()) <= len(layout.fields) + 1, calls
