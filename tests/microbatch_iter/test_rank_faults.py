"""A CPU rank's hand-outs make its process take no page fault per micro-batch, so releases skip
the page-map read, in a rank process of its own too (issue 31; NOTE [ Lease backstop ] in
knitkit/storage/delivery/consumer.py)."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np

from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.types import MicroBatchLayout

COUNT = 150
BOUND_S = 60.0
READS = "knitkit/delivery/page_map_reads"


def _layout(index: int) -> MicroBatchLayout:
    tokens = 4096 + 64 * (index % 5)  # packed token counts vary
    return MicroBatchLayout.build(
        {
            "tokens": ("int64", (tokens,)),
            "position_ids": ("int64", (tokens,)),
            "logprobs": ("float32", (tokens,)),
            "loss_mask": ("float32", (tokens,)),
            "cu_seqlens": ("int32", (9,)),
        },
        trajectory_ids=tuple(f"t{index}-{k}" for k in range(8)),
    )


def _rank(spec: RingSpec, results: multiprocessing.SimpleQueue) -> None:
    """Read every micro-batch through the iterator (zero copy, never writing); report the
    page-map reads, or what went wrong."""
    try:
        consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=BOUND_S)
        config = MicroBatchIterator.Config(depth=2, next_timeout_s=BOUND_S)
        with consumer, MicroBatchIterator(consumer.take(COUNT), config, device="cpu") as batches:
            for index, batch in enumerate(batches):
                if not np.all(batch["tokens"].numpy() == index):
                    raise AssertionError(f"micro-batch {index} arrived changed")
            results.put(consumer.metrics()[READS])
    except BaseException as error:
        results.put(repr(error))


def test_forked_rank_releases_skip_the_page_map() -> None:
    """A rank process reads 150 micro-batches of varying layouts while its producer publishes:
    at most a quarter of its releases read the page map (with a weakref.finalize per lease, its
    process faulted once per hand-out and nearly every release read it)."""
    spec = RingSpec.new(num_slots=4, slot_bytes=1 << 17, num_consumers=1)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    # spawned (a fresh interpreter, as torchrun starts ranks): a child forked from pytest
    # inherits its heap, fragmented by every test before, and takes copy-on-write faults
    # wherever it allocates in it (2 of 6 runs of tests/microbatch_iter read the page map on
    # 41-42 of 150 releases); forked by the suite's fork server, 111 in one whole-suite run
    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    rank = context.Process(target=_rank, args=(spec, results), daemon=True)
    rank.start()

    def produce() -> None:  # a rank that never attaches leaves it waiting: the stop ends it
        for index in range(COUNT):
            layout = _layout(index)
            layout.numpy_views(publisher.acquire(layout.nbytes))["tokens"][:] = index
            publisher.publish(layout)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    try:
        rank.join(BOUND_S)
        assert rank.exitcode == 0
        reads = results.get()
        assert isinstance(reads, float), reads
        assert reads <= COUNT / 4, f"{reads:.0f} of {COUNT} releases read the page map"
    finally:
        if rank.is_alive():
            rank.kill()
        owner.request_stop()
        producer.join(BOUND_S)
        publisher.close()
        owner.close()
        owner.unlink()
