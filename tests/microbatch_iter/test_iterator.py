"""MicroBatchIterator on CPU: order, errors, early stop, shutdown, bounded memory, pool reuse."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from knitkit.microbatch_iter import MicroBatchIterator, PrefetchThreads

PREFIX = "knitkit-microbatch-prefetch-"


def prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(PREFIX)}


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def assert_fields(mb, expected: dict[str, np.ndarray]) -> None:
    assert list(mb.tensors) == list(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(mb[name].numpy(), array, err_msg=f"field {name}")


@pytest.mark.parametrize("depth", [1, 3])
def test_yields_every_micro_batch_in_order_with_its_content(
    depth, counting_source, expected_fields
):
    """Micro-batch i comes out i-th, with exactly its fields, for variable sizes and any depth."""
    sizes = (17, 300, 64, 1)
    source = counting_source(40, sizes)
    indices = []
    with MicroBatchIterator(source, MicroBatchIterator.Config(depth=depth), device="cpu") as it:
        for mb in it:
            assert_fields(mb, expected_fields(mb.index, sizes[mb.index % len(sizes)]))
            indices.append(mb.index)
    assert indices == list(range(40))
    assert it.stats.count == 40


def test_packed_items_from_a_reused_shared_memory_slot_are_released_only_after_use(
    shm_reorganizer, expected_fields
):
    """A packed item is released only once the consumer moved past it (CPU: zero copy): the
    reused /dev/shm slot is never refilled under a micro-batch the consumer reads."""
    reorganizer = shm_reorganizer(30, tokens=128)
    config = MicroBatchIterator.Config(depth=3)
    with MicroBatchIterator(reorganizer, config, device="cpu") as it:
        for mb in it:
            time.sleep(0.002)  # the reorganizer refills its slot meanwhile
            assert_fields(mb, expected_fields(mb.index, 128))
            assert mb.layout.extra["micro_batch"] == mb.index
    assert reorganizer.released == 30


def test_dict_of_tensors_keeps_bfloat16_and_shapes():
    """Torch fields (bfloat16 included) come back with their dtype, shape and values."""
    items = [{"x": torch.randn(5, 3).to(torch.bfloat16), "m": torch.ones(5, dtype=torch.bool)}]
    with MicroBatchIterator(items, device="cpu") as it:
        mb = next(it)
        assert mb["x"].dtype == torch.bfloat16 and mb["x"].shape == (5, 3)
        assert torch.equal(mb["x"], items[0]["x"]) and mb["m"].all()


def _failing_source(fail_at: int) -> Iterator[dict[str, np.ndarray]]:
    for i in range(100):
        if i == fail_at:
            raise ValueError(f"source broke at micro-batch {i}")
        yield {"x": np.full(4, i, dtype=np.int64)}


def test_source_exception_is_raised_at_next_with_the_original_traceback():
    """Items before the failure arrive; then next() raises the source's own exception and frames."""
    before = prefetch_threads()
    it = MicroBatchIterator(_failing_source(3), device="cpu")
    got = [int(next(it)["x"][0]) for _ in range(3)]
    with pytest.raises(ValueError, match="micro-batch 3") as info:
        next(it)
    assert got == [0, 1, 2]
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "_failing_source" in frames
    with pytest.raises(StopIteration):
        next(it)
    assert prefetch_threads() == before


def test_malformed_item_raises_a_type_error_that_names_it():
    """A staging error in the thread reaches the consumer and says what the item should be."""
    with (
        MicroBatchIterator([object()], device="cpu") as it,
        pytest.raises(TypeError, match="object"),
    ):
        next(it)


def test_early_stop_with_context_manager_stops_thread_and_closes_source(counting_source):
    """Leaving the with-block mid-stream stops the thread and closes the source."""
    source = counting_source(10_000)
    before = prefetch_threads()
    with MicroBatchIterator(source, device="cpu") as it:
        for mb in it:
            if mb.index == 2:
                break
    assert prefetch_threads() == before
    assert source.closed and source.pulled < 10_000
    assert it.pool.held_bytes == 0


def test_garbage_collection_stops_the_thread(counting_source):
    """Dropping the last reference to a running iterator stops its thread (no reference cycle)."""
    before = prefetch_threads()
    it = MicroBatchIterator(counting_source(10_000), device="cpu")
    next(it)
    assert len(prefetch_threads() - before) == 1
    del it
    gc.collect()
    assert wait_until(lambda: prefetch_threads() == before, timeout=30)


@pytest.mark.parametrize(("depth", "refill"), [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (2, 3)])
def test_prefetch_never_runs_more_than_depth_plus_refill_minus_one_ahead(
    depth, refill, counting_source
):
    """The source is pulled at most ``depth + refill - 1`` items past the one the consumer holds
    (NOTE [ Refills in batches ]), and reaches it; ``depth + refill`` slots hold them."""
    source = counting_source(20, sizes=(100, 900))
    ahead = []
    config = MicroBatchIterator.Config(depth=depth, refill=refill)
    with MicroBatchIterator(source, config, device="cpu") as it:
        for mb in it:
            time.sleep(0.02)  # slow consumer: the thread would run ahead if it could
            ahead.append(source.pulled - (mb.index + 1))
            assert it.pool.held_bytes <= (depth + refill) * 16384  # 900 tokens = 14.1 KiB
    assert max(ahead) == depth + refill - 1


@pytest.mark.parametrize(("depth", "refill"), [(1, 2), (2, 2), (2, 3)])
def test_the_thread_is_woken_once_per_refill_micro_batches(depth, refill, counting_source):
    """Credits go back ``refill`` at a time (NOTE [ Refills in batches ]): item j past the first
    ``depth + refill - 1`` is pulled only once the loop has started the ``next()`` that returns
    its credit, the ``refill``-th since the last return; the look-ahead never falls below
    ``depth - 1`` at a hand-over."""
    calls = [0]  # next() calls the loop has started
    at_pull: list[int] = []
    inner = counting_source(24)

    def source() -> Iterator[dict[str, np.ndarray]]:
        for item in inner:
            at_pull.append(calls[0])
            yield item

    first_gated = depth + refill - 1
    config = MicroBatchIterator.Config(depth=depth, refill=refill, next_timeout_s=60.0)
    with MicroBatchIterator(source(), config, device="cpu") as it:
        for index in range(24):
            calls[0] += 1
            mb = next(it)
            assert mb.index == index
            assert wait_until(lambda i=index: inner.pulled >= min(24, i + depth), 60.0)
            time.sleep(0.005)  # the thread, once woken, pulls what its credits allow
    for j, seen in enumerate(at_pull[first_gated:], start=first_gated):
        assert seen >= refill * ((j - first_gated) // refill + 1), (j, at_pull)


def test_on_cpu_the_thread_refills_two_at_a_time_by_default(counting_source):
    """On CPU the default refill is 2 (the loop's thread computes there: each wake of the
    prefetch thread costs it a cross-CPU wake right after compute), so the ring has
    ``depth + 2`` slots."""
    config = MicroBatchIterator.Config(depth=2, slot_nbytes=1 << 12)
    with MicroBatchIterator(counting_source(4), config, device="cpu") as it:
        assert it._prefetcher.refill == 2
        assert it.pool.allocations == 4


def test_pool_is_reused_after_the_largest_micro_batch(counting_source):
    """Slots grow to powers of two for the largest size seen, then are reused with no allocation."""
    sizes = (50, 400, 120, 10)
    source = counting_source(200, sizes)
    config = MicroBatchIterator.Config(depth=2)
    states = []
    with MicroBatchIterator(source, config, device="cpu") as it:
        for mb in it:
            if mb.index >= 20:  # every slot has seen the largest size by now
                pointers = [slot.host.data_ptr() for slot in it.pool.slots]
                states.append((it.pool.allocations, pointers))
    assert all(state == states[0] for state in states)
    assert states[0][0] <= 4 * 3  # 4 slots (depth 2 + refill 2), at most 3 sizes each
    assert it.pool.held_bytes == 0  # exhausting the source closed the iterator


def test_slot_nbytes_preallocates_once(counting_source):
    """With slots sized at start-up, no allocation happens while iterating."""
    config = MicroBatchIterator.Config(depth=2, refill=1, slot_nbytes=1 << 16)
    with MicroBatchIterator(counting_source(50, (10, 1000)), config, device="cpu") as it:
        assert it.pool.allocations == 3
        sum(1 for _ in it)
        assert it.pool.allocations == 3


def test_stage_after_launch_holds_staging_until_launched(counting_source):
    """With stage_after_launch (and a refill of 1: a credit per launch), the next pull waits
    for launched(); next() alone still progresses."""
    source = counting_source(6)
    config = MicroBatchIterator.Config(depth=1, refill=1, stage_after_launch=True)
    with MicroBatchIterator(source, config, device="cpu") as it:
        next(it)
        time.sleep(0.2)
        assert source.pulled == 1
        it.launched()
        assert wait_until(lambda: source.pulled == 2)
        assert [mb.index for mb in it] == [1, 2, 3, 4, 5]


def test_stats_report_waits_fetch_time_and_bytes():
    """A source slower than the consumer shows up as exposed wait; bytes add up per micro-batch."""

    def slow():
        for i in range(5):
            time.sleep(0.03)
            yield {"x": np.zeros(100 + i, dtype=np.float32)}

    with MicroBatchIterator(slow(), device="cpu") as it:
        delivered = [mb.stats for mb in it]
    assert all(s.fetch_s >= 0.025 for s in delivered)
    assert all(s.wait_s >= 0.01 for s in delivered[1:])
    assert it.stats.count == 5
    assert it.stats.nbytes == sum(s.nbytes for s in delivered) == sum(448 for _ in range(5))
    assert it.stats.wait_s == pytest.approx(sum(s.wait_s for s in delivered))


def test_closing_over_a_blocked_source_returns_and_warns():
    """close() over a source stuck in next() returns after join_timeout_s and says why."""
    gate = threading.Event()

    def blocked():
        gate.wait()
        yield {"x": np.zeros(1)}

    before = prefetch_threads()
    it = MicroBatchIterator(blocked(), MicroBatchIterator.Config(join_timeout_s=0.2), device="cpu")
    start = time.monotonic()
    with pytest.warns(ResourceWarning, match="next\\(source\\)"):
        it.close()
    assert time.monotonic() - start < 2.0
    gate.set()
    assert wait_until(lambda: prefetch_threads() == before, timeout=30)


@pytest.mark.parametrize(
    "body",
    [
        "it = MicroBatchIterator(endless(), device='cpu'); next(it)",
        "it = MicroBatchIterator(stuck(), device='cpu')",
    ],
    ids=["abandoned-mid-stream", "source-blocked-forever"],
)
def test_process_exits_promptly_without_close(body):
    """A consumer that stops early and never closes (even over a stuck source) never hangs exit."""
    script = (
        textwrap.dedent(
            """
        import threading, numpy as np
        from knitkit.microbatch_iter import MicroBatchIterator
        def endless():
            while True:
                yield {"x": np.zeros(1000)}
        def stuck():
            threading.Event().wait()
            yield {}
        """
        )
        + body
    )
    done = subprocess.run(
        [sys.executable, "-c", script], timeout=60, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_config_build_and_invalid_depth():
    """Config.build wires source and device; a depth below 1 is refused with its value."""
    with MicroBatchIterator.Config(depth=1).build([{"x": np.ones(2)}], device="cpu") as it:
        assert it.device == torch.device("cpu") and next(it)["x"].sum() == 2
    with pytest.raises(ValueError, match="depth=0"):
        MicroBatchIterator([], MicroBatchIterator.Config(depth=0), device="cpu")


def test_next_waits_are_bounded_by_default():
    """No public wait is unbounded by default: next() over a source that never yields raises
    TimeoutError after next_timeout_s (finite by default) instead of hanging the trainer."""
    assert MicroBatchIterator.Config().next_timeout_s < float("inf")
    gate = threading.Event()

    def stuck():
        gate.wait()
        yield {"x": np.zeros(1)}

    config = MicroBatchIterator.Config(next_timeout_s=0.3, join_timeout_s=0.2)
    it = MicroBatchIterator(stuck(), config, device="cpu")
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"next_timeout_s=0\.3"):
            next(it)
        assert time.monotonic() - start < 30
    finally:
        gate.set()
        it.close()


def test_warm_start_stages_the_first_micro_batch_before_the_loop_asks(expected_fields):
    """The prefetch thread starts at construction: a first micro-batch that takes 0.5 s to
    prepare, prepared while the loop does other work, is handed over without that wait."""
    asked_for_second = threading.Event()

    def source() -> Iterator[dict[str, np.ndarray]]:
        time.sleep(0.5)  # the first micro-batch's preparation
        yield expected_fields(0, 64)
        asked_for_second.set()  # the thread staged micro-batch 0 before pulling again
        yield expected_fields(1, 64)

    with MicroBatchIterator(source(), MicroBatchIterator.Config(depth=2), device="cpu") as it:
        assert asked_for_second.wait(60)  # the loop's own work before its first next()
        first = next(it)
        assert first.stats.wait_s < first.stats.fetch_s
        assert first.stats.fetch_s >= 0.5
        assert_fields(first, expected_fields(0, 64))
        assert [mb.index for mb in it] == [1]


# ----- PrefetchThreads: a rank's iterators reuse prefetch threads, each prefetch still ends as its
# own thread did (NOTE [ One prefetch thread per rank ])
def _items(n: int, fail_at: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    for i in range(n):
        if i == fail_at:
            raise ValueError(f"source broke at micro-batch {i}")
        yield {"x": np.full(4, i, dtype=np.int64)}


def _ident(_batch: object) -> int:
    return threading.get_ident()


def test_passes_one_after_another_run_on_one_thread_and_close_ends_it():
    """Five iterators in turn (one failing) start one thread between them; each delivers all of
    its data in order, the failure reaches its next(), and the set's close() ends the thread."""
    before = prefetch_threads()
    threads = PrefetchThreads()
    config = MicroBatchIterator.Config(depth=2)
    idents: set[int] = set()
    for n in (3, 1, 4):
        with MicroBatchIterator(_items(n), config, device="cpu", threads=threads) as it:
            assert [int(mb["x"][0]) for mb in it] == list(range(n))
            idents.add(it._prefetcher.thread.ident)  # type: ignore[arg-type]
    failing = MicroBatchIterator(_items(5, fail_at=2), config, device="cpu", threads=threads)
    assert [int(next(failing)["x"][0]) for _ in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="micro-batch 2"):
        next(failing)
    with MicroBatchIterator(_items(2), config, device="cpu", threads=threads, convert=_ident) as it:
        idents.update(list(it))
    assert threads.started == 1 and len(idents) == 1
    assert len(prefetch_threads() - before) == 1
    threads.close()
    assert wait_until(lambda: prefetch_threads() == before, timeout=30)


def test_a_reused_thread_starts_each_prefetch_with_grad_mode_on_as_a_new_thread_does():
    """A conversion that turns grad mode off without a context manager leaves it off on its
    thread; the next iterator's conversion, on that same thread, still sees it on."""
    threads = PrefetchThreads()
    config = MicroBatchIterator.Config(depth=1)

    def switch_off(_batch: object) -> tuple[int, bool]:
        seen = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        return threading.get_ident(), seen

    def observe(_batch: object) -> tuple[int, bool]:
        return threading.get_ident(), torch.is_grad_enabled()

    try:
        seen = []
        for convert in (switch_off, observe):
            with MicroBatchIterator(
                _items(1), config, device="cpu", threads=threads, convert=convert
            ) as it:
                seen.extend(it)
        assert threads.started == 1 and seen[0][0] == seen[1][0]
        assert [on for _, on in seen] == [True, True]
    finally:
        threads.close()


def test_overlapping_passes_get_their_own_threads_and_a_stuck_one_is_not_reused():
    """Two open iterators run on two threads; a thread left inside an uninterruptible source
    after close() is not handed the next iterator, and ends once the source returns."""
    threads = PrefetchThreads()
    blocked, release = threading.Event(), threading.Event()

    def stuck() -> Iterator[dict[str, np.ndarray]]:
        yield {"x": np.zeros(4, dtype=np.int64)}
        blocked.set()
        release.wait(30)
        yield {"x": np.ones(4, dtype=np.int64)}

    config = MicroBatchIterator.Config(depth=1, join_timeout_s=0.05)
    first = MicroBatchIterator(stuck(), config, device="cpu", threads=threads, convert=_ident)
    second = MicroBatchIterator(_items(1), config, device="cpu", threads=threads, convert=_ident)
    a, b = next(first), next(second)
    assert a != b and threads.started == 2
    assert blocked.wait(10)
    with pytest.warns(ResourceWarning, match="still inside next"):
        first.close()
    second.close()
    with MicroBatchIterator(_items(1), config, device="cpu", threads=threads, convert=_ident) as it:
        assert next(it) == b  # the idle thread, not the stuck one
    assert threads.started == 2
    stuck_thread = first._prefetcher.thread
    threads.close()
    release.set()
    assert wait_until(lambda: not stuck_thread.is_alive(), timeout=30)
