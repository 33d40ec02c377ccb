"""Settled trajectory ids and discarded GRPO groups of the last two train batches (the duplicate window)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

GroupKey = tuple[str, str]
"""A GRPO group: (source, sample_id)."""

# NOTE [ Duplicate window ]: a retried report must be refused, and the controller used to keep
# every id ever reported to do it: the state grew with the whole run (2M reported: 22.9 MB of
# JSON, 8.8 s to save; issue 30). Two bounded alternatives: a compact structure (a Bloom
# filter: a fixed size, but a false positive refuses a new trajectory, and the caller cannot
# tell it from a real retry) or a window. The controller uses a window, exact inside it: an id
# is refused while it is pending (the pool and incomplete groups hold it anyway), and after it
# settles (admitted, rejected, expired by ``max_staleness`` or discarded) for the rest of the
# train batch it settled in and the whole next one. A retry comes from a rollout worker that
# did not see its report acknowledged, so it arrives while the first copy is pending or
# shortly after; one that arrives later than a full train batch after its trajectory settled
# is taken as new (the caller keeps its own record if its retries can be that late). The
# state then holds what is pending plus what settled in two train batches, whatever was
# reported before (``benchmarks/checkpoint.py``, ``admission.*`` figures). Members of a GRPO group that
# ``discard_pending()`` dropped are recognised over the same window (the group's key, rollout
# step and members still expected) and discarded on arrival, counted in ``stats.discarded``
# and ``stats.discarded_late``; later than the window they would start a group that never
# completes. Ids are kept in dicts (insertion order), so a saved and restored window lists
# them in the same order and a restored controller's state dict equals the original's.


@dataclass(slots=True)
class Generation:
    """What settled during one train batch."""

    ids: dict[str, None] = field(default_factory=dict)
    groups: dict[GroupKey, list[int]] = field(default_factory=dict)
    """Discarded GRPO groups: [rollout step, members still expected]."""


class RecentWindow:
    """Ids settled, and GRPO groups discarded, in the open train batch and the one before."""

    __slots__ = ("current", "previous")

    def __init__(self, previous: Generation | None = None, current: Generation | None = None):
        self.previous = previous or Generation()
        self.current = current or Generation()

    def __contains__(self, trajectory_id: str) -> bool:
        return trajectory_id in self.current.ids or trajectory_id in self.previous.ids

    def settle(self, ids: Iterable[str]) -> None:
        """Record trajectories that left the pending state (admitted, rejected, dropped)."""
        self.current.ids.update(dict.fromkeys(ids))

    def discard_group(self, key: GroupKey, rollout_step: int, expected: int) -> None:
        """Record an incomplete group ``discard_pending()`` dropped, ``expected`` members short."""
        self.current.groups[key] = [rollout_step, expected]

    def late_member(self, key: GroupKey, rollout_step: int) -> bool:
        """True (and one member fewer expected) if ``key`` names a discarded group of that step."""
        for generation in (self.current, self.previous):
            entry = generation.groups.get(key)
            if entry is not None and entry[0] == rollout_step:
                entry[1] -= 1
                if entry[1] == 0:
                    del generation.groups[key]
                return True
        return False

    def rotate(self) -> None:
        """A train batch closed: forget what settled before it opened."""
        self.previous, self.current = self.current, Generation()

    def copy(self) -> RecentWindow:
        """An independent copy (for a snapshot): O(ids in the window)."""
        return RecentWindow(*(_copy(g) for g in (self.previous, self.current)))


def _copy(generation: Generation) -> Generation:
    return Generation(dict(generation.ids), {k: list(v) for k, v in generation.groups.items()})
