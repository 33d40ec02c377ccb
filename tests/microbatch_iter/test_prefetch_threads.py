"""PrefetchThreads: a rank's iterators reuse prefetch threads, each prefetch still ends as its own
thread did (NOTE [ One prefetch thread per rank ])."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from knitkit.microbatch_iter import MicroBatchIterator, PrefetchThreads

PREFIX = "knitkit-microbatch-prefetch-"


def prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(PREFIX)}


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


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
    assert wait_until(lambda: prefetch_threads() == before)


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
    assert wait_until(lambda: not stuck_thread.is_alive())
