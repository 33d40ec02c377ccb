"""Counting the Python frames a piece of code enters: tests that bound per-item Python work
count calls, which load does not blur (the project's rule against timed unit tests)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType


def python_calls(run: Callable[[], object]) -> int:
    """Python frames entered (generator resumptions included) while ``run`` runs."""
    calls = 0

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls
