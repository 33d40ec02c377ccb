"""The ready pool: accepted, not yet admitted units in one FIFO queue per source, with counters."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from knitkit.types import TrajectoryMeta


@dataclass(frozen=True, slots=True)
class Unit:
    """What admission moves atomically: one trajectory, or a whole GRPO group when groups are atomic."""

    seq: int
    """Completion order across all sources (smaller is older)."""
    source: str
    trajectories: tuple[TrajectoryMeta, ...]

    @property
    def size(self) -> int:
        return len(self.trajectories)

    @property
    def min_version(self) -> int:
        return min(t.min_version for t in self.trajectories)

    @property
    def version_sum(self) -> int:
        """Sum of the oldest and newest versions over the unit: smaller means staler tokens."""
        return sum(t.min_version + t.max_version for t in self.trajectories)


class ReadyPool:
    """Per-source FIFO queues of ready units; counts are kept so readiness checks are O(#sources).

    Selection only ever takes a prefix of each source's queue (oldest-first within a source), so
    a candidate is fully described by a count of units per source.
    """

    __slots__ = ("_queues", "ready", "total")

    def __init__(self, sources: Iterable[str]) -> None:
        self._queues: dict[str, deque[Unit]] = {s: deque() for s in sources}
        self.ready: dict[str, int] = dict.fromkeys(self._queues, 0)
        """Ready trajectories per source (sum of unit sizes)."""
        self.total = 0
        """Ready trajectories over all sources."""

    def __len__(self) -> int:
        return self.total

    def push(self, unit: Unit) -> None:
        self._queues[unit.source].append(unit)
        self.ready[unit.source] += len(unit.trajectories)
        self.total += len(unit.trajectories)

    def units(self, source: str) -> int:
        return len(self._queues[source])

    def peek(self, source: str, index: int) -> Unit:
        """The ``index``-th oldest ready unit of ``source`` (index 0 is the head)."""
        return self._queues[source][index]

    def take(self, counts: dict[str, int]) -> list[Unit]:
        """Remove and return the ``counts[source]`` oldest units of each source."""
        taken: list[Unit] = []
        for source, count in counts.items():
            queue = self._queues[source]
            for _ in range(count):
                unit = queue.popleft()
                self.ready[source] -= unit.size
                self.total -= unit.size
                taken.append(unit)
        taken.sort(key=lambda u: u.seq)
        return taken

    def drop_where(self, predicate: Callable[[Unit], bool]) -> list[Unit]:
        """Remove every unit matching ``predicate`` (O(pending); called once per train batch)."""
        dropped: list[Unit] = []
        for source, queue in self._queues.items():
            kept = deque(u for u in queue if not predicate(u))
            if len(kept) != len(queue):
                dropped.extend(u for u in queue if predicate(u))
                self._queues[source] = kept
                self.total -= self.ready[source]
                self.ready[source] = sum(u.size for u in kept)
                self.total += self.ready[source]
        return dropped
