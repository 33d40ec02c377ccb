"""Clean-ups that run only in the process that owns a resource, never in a forked child."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any


class OwnerFinalizer:
    """``weakref.finalize`` whose callback runs only in the process that created it.

    NOTE [ Owner-only clean-up ]: a forked child (a DataLoader worker, ``subprocess`` with fork,
    Ray's worker forks) inherits a copy of every object and of the finalizer registry; when it
    exits normally, ``weakref.finalize``'s exit hook runs every finalizer still alive in the
    child, and an explicit ``close()`` on an inherited object runs it too. A finalizer that
    unlinks shared memory or stops a helper process would then destroy its parent's live
    resource. This wrapper remembers the creating pid; called in any other process it only marks
    itself dead there (it never runs twice) and does nothing. Every clean-up of a shared
    resource (a backend's slabs, journal and owner lock; a reorganizer's ring and process) goes
    through it, and so does every ``close()`` path, since ``close()`` calls the finalizer. Lifecycle
    table: docs/lifecycle.md.
    """

    __slots__ = ("_finalize", "pid")

    def __init__(self, obj: object, func: Callable[..., Any], /, *args: Any) -> None:
        self.pid = os.getpid()
        """The owning process."""
        self._finalize = weakref.finalize(obj, _in_owner, self.pid, func, args)

    def __call__(self) -> None:
        """Run the clean-up now (in the owner; once); a no-op in other processes."""
        self._finalize()

    @property
    def alive(self) -> bool:
        """Not yet run (or skipped) in this process."""
        return self._finalize.alive

    @property
    def in_owner(self) -> bool:
        """Whether this is the owning process (not a forked child)."""
        return os.getpid() == self.pid


def _in_owner(pid: int, func: Callable[..., Any], args: tuple[Any, ...]) -> None:
    if os.getpid() == pid:  # see NOTE [ Owner-only clean-up ]
        func(*args)
