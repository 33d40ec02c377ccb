"""CPU zero-copy hand-off from a real reorganizer process: tensors view the published /dev/shm slot.

See NOTE [ Zero-copy hand-off ] in knitkit/microbatch_iter/worker.py. A reorganizer process
packs micro-batches into a ring of TWO slots, so a slot released too early is refilled with a
later micro-batch at once and the consumer would read the wrong tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.storage import (
    MicroBatchConsumer,
    PlannerConfig,
    ReorganizerProcess,
    RingSpec,
    SharedMemoryBackend,
    Topology,
    plan_minibatch,
)
from knitkit.storage.delivery.slot_ring import SlotRing
from knitkit.types import TrajectoryMeta, UnitKey

LENGTHS = [90, 140, 60, 200, 120, 80, 170, 50]


@pytest.fixture
def published() -> Iterator[tuple[RingSpec, int]]:
    """A reorganizer process publishing two mini-batches of micro-batches into a 2-slot ring;
    yields (ring spec, number of micro-batches). Token ids encode (trajectory, position)."""
    backend = SharedMemoryBackend(slab_bytes=1 << 20)
    metas = []
    for i, n in enumerate(LENGTHS):
        metas.append(TrajectoryMeta(f"t{i}", f"s{i // 2}", "src", 0, n, 0, 0))
        backend.put(UnitKey(f"t{i}", "tokens"), (i << 16) + np.arange(n, dtype=np.int32))
    config = PlannerConfig(
        token_fields=("tokens",),
        scalar_fields=(),
        max_tokens_per_micro_batch=256,
        min_micro_batches=2,
    )
    plans = [plan_minibatch(metas, Topology(dp=1), config, minibatch_id=f"mb{j}") for j in (0, 1)]
    spec = RingSpec.new(num_slots=2, slot_bytes=1 << 16, num_consumers=1)
    count = sum(len(plan.consumer(0, 0).micro_batches) for plan in plans)
    with ReorganizerProcess(backend, spec) as reorganizer:
        for plan in plans:
            reorganizer.submit(plan.minibatch_id, plan.consumer(0, 0))
        reorganizer.finish(timeout_s=0)
        yield spec, count
    backend.close()


def _real_tokens(tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Non-padding token ids, after checking each encodes its position in its trajectory."""
    real = tokens[mask > 0]
    positions = real & 0xFFFF
    starts = np.flatnonzero(np.diff(real >> 16, prepend=-1))
    for begin, end in zip(starts, [*starts[1:], len(real)], strict=True):
        assert np.array_equal(positions[begin:end], np.arange(end - begin))
    return real


@pytest.mark.filterwarnings("error")  # torch's warning on a read-only array included
def test_cpu_iterator_hands_over_the_published_slot_without_a_copy(published):
    """On CPU the iterator stages nothing: every micro-batch's tensors view the published slot
    and carry exactly the tokens the reorganizer packed (each trajectory once per mini-batch)."""
    spec, count = published
    seen = []
    consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=60.0)
    with MicroBatchIterator(consumer, MicroBatchIterator.Config(depth=2), device="cpu") as it:
        for mb in it:
            assert mb.flat.untyped_storage().nbytes() <= spec.slot_bytes  # a slot, not a copy
            seen.append(_real_tokens(mb["tokens"].numpy(), mb["loss_mask"].numpy()).copy())
        assert it.pool.allocations == 0
    assert len(seen) == count
    every = np.sort(np.concatenate(seen))
    expected = np.concatenate([(i << 16) + np.arange(n) for i, n in enumerate(LENGTHS)])
    assert np.array_equal(every, np.sort(np.concatenate([expected, expected])))


def test_a_held_micro_batch_stays_valid_until_next_and_nothing_is_leaked(published):
    """Lifetime rule: the slot of the micro-batch the consumer holds is not released before its
    next next() (its tensors keep their values while the reorganizer waits to refill), every
    slot is released at the end, and close() mid-stream releases what was pulled ahead."""
    spec, count = published
    observer = SlotRing.attach(spec)
    try:
        consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=60.0)
        config = MicroBatchIterator.Config(depth=2)
        with MicroBatchIterator(consumer, config, device="cpu") as it:
            for mb in it:
                before = mb["tokens"].clone()
                deadline = time.monotonic() + 0.05  # room for a wrongly freed slot's refill
                while time.monotonic() < deadline:
                    assert observer.released(0) <= mb.index  # not handed back while held
                    time.sleep(0.005)
                assert np.array_equal(mb["tokens"].numpy(), before.numpy())
                _real_tokens(mb["tokens"].numpy(), mb["loss_mask"].numpy())
        assert observer.released(0) == count  # nothing leaked
    finally:
        observer.close()


def test_close_mid_stream_releases_the_held_and_the_prefetched(published):
    """close() after the first micro-batch releases it and every micro-batch pulled ahead: the
    release count equals what the iterator took from the ring."""
    spec, _ = published
    observer = SlotRing.attach(spec)
    try:
        consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=60.0)
        it = MicroBatchIterator(consumer, MicroBatchIterator.Config(depth=2), device="cpu")
        mb = next(it)
        assert mb.index == 0
        deadline = time.monotonic() + 30
        while observer.published < 2 and time.monotonic() < deadline:  # let it pull ahead
            time.sleep(0.01)
        assert observer.released(0) == 0
        it.close()
        taken = consumer._next  # micro-batches the iterator pulled from the ring
        assert taken >= 1
        assert observer.released(0) == taken  # the held one and every prefetched one
    finally:
        observer.close()
