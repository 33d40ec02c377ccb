"""Runs started in the background, two at a time, for parametrized tests that each check one."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

PARALLEL = 2
"""Runs at once, on the 2 cores the suite is sized for: one run's waits (process starts,
imports, rendezvous) overlap the other's work."""


def selected(
    request: pytest.FixtureRequest, test: Callable[..., object], argname: str
) -> list[Any]:
    """The ``argname`` values of ``test``'s collected items (what ``-k`` left), in run order."""
    return [
        item.callspec.params[argname]  # type: ignore[attr-defined]
        for item in request.session.items
        if getattr(item, "function", None) is test
    ]


@contextmanager
def in_background(
    calls: dict[K, Callable[[], T]], parallel: int = PARALLEL
) -> Iterator[dict[K, Future[T]]]:
    """Start ``calls`` ``parallel`` at a time, in order; each test waits for its own future.
    Leaving cancels the runs not started and waits for the running ones."""
    with ThreadPoolExecutor(parallel, thread_name_prefix="background-run") as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
        try:
            yield futures
        finally:
            for future in futures.values():
                future.cancel()
