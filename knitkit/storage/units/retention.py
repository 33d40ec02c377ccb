"""Deletes of durable units that a saved store state still names wait until no loadable state does."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from knitkit.types import UnitKey

KEPT_STATES = 2
"""States whose units survive deletes: the newest one and the one before it."""


class DeferredDeletes:
    """The units of the last ``KEPT_STATES`` states taken, and the deletes waiting for them.

    NOTE [ Units outlive their last state ]: a store's state (``TrajectoryStore.state_dict``)
    holds the index, not the bytes; on a durable backend the bytes stay in the backend. A unit
    freed after a state was taken (its mini-batch trained) is still named by that state, and a
    crash before the next checkpoint resumes from it: had the unit been deleted, the resumed run
    would miss it. So on a durable backend a delete of a unit that one of the last two states
    names is deferred, and done when a later state is taken that no longer keeps it. Two, not
    one: the newest state may still be being saved when the process dies, and then the one
    before it is the checkpoint that loads (this assumes, as a save loop does, that a state is
    saved before the next one is taken). A deferred unit that is written again meanwhile
    (a multimodal input with the same content, so the same bytes) is revived instead of copied.
    """

    def __init__(self) -> None:
        self._states: deque[frozenset[UnitKey]] = deque(maxlen=KEPT_STATES)
        self._deferred: set[UnitKey] = set()

    def holds(self, key: UnitKey) -> bool:
        """Whether a state that may still be loaded names ``key``."""
        return any(key in state for state in self._states)

    def defer(self, key: UnitKey) -> None:
        self._deferred.add(key)

    def revive(self, key: UnitKey) -> bool:
        """Take ``key`` off the deferred deletes (it is live again); whether it was there."""
        if key in self._deferred:
            self._deferred.discard(key)
            return True
        return False

    def taken(self, keys: Iterable[UnitKey]) -> list[UnitKey]:
        """A state naming ``keys`` was taken: the deferred units no kept state names any more,
        which the caller now deletes."""
        self._states.append(frozenset(keys))
        due = [k for k in self._deferred if not self.holds(k)]
        self._deferred.difference_update(due)
        return due

    @property
    def pending(self) -> int:
        """Deletes still waiting."""
        return len(self._deferred)
