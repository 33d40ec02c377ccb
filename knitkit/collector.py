"""One process-wide pause of CPython's garbage collector, shared by every part that builds many
acyclic objects in one call (the planner, admission's state load)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_pause_lock = threading.Lock()
_pausing = 0
_resume = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the garbage collector for the block; threads pausing at once share one count, and
    the last one out switches it back on if it was on when the first went in (the protocol is
    NOTE [ Planner and the garbage collector ] in knitkit/storage/planning/planner.py)."""
    global _pausing, _resume
    with _pause_lock:
        if _pausing == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pausing += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pausing -= 1
            if _pausing == 0 and _resume:
                gc.enable()
