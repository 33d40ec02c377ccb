"""The ready pool: accepted, not yet admitted units in one FIFO queue per source, with counters."""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator
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


class ReadyPool:
    """Per-source FIFO queues of ready units; counts are kept so readiness checks are O(#sources).

    Selection only ever takes a prefix of each source's queue (oldest-first within a source), so
    a candidate is fully described by a count of units per source. Units are also bucketed by
    their oldest version, so ``expire_older_than`` costs O(expired), not O(pending) (NOTE [ Lazy
    version buckets ]).
    """

    __slots__ = ("_buckets", "_entries", "_queues", "_units", "_versions", "ready", "total")

    def __init__(self, sources: Iterable[str]) -> None:
        self._queues: dict[str, OrderedDict[int, Unit]] = {s: OrderedDict() for s in sources}
        self._buckets: dict[int, list[tuple[int, str]]] = {}
        """oldest version -> (seq, source) of its units, including lazily kept taken ones."""
        self._versions: list[int] = []
        """Min-heap of the bucket keys."""
        self._entries = 0
        """Bucket entries, live or taken."""
        self._units = 0
        """Ready units over all sources."""
        self.ready: dict[str, int] = dict.fromkeys(self._queues, 0)
        """Ready trajectories per source (sum of unit sizes)."""
        self.total = 0
        """Ready trajectories over all sources."""

    def __len__(self) -> int:
        return self.total

    def push(self, unit: Unit) -> None:
        self._queues[unit.source][unit.seq] = unit
        self.ready[unit.source] += unit.size
        self.total += unit.size
        self._units += 1
        self._bucket(unit.min_version).append((unit.seq, unit.source))
        self._entries += 1
        # NOTE [ Lazy version buckets ]: a taken unit keeps its bucket entry until its version
        # expires; rebuild the buckets from the live units when dead entries outnumber them
        # (amortised O(1) per push), so memory stays O(pending) even if nothing ever expires.
        if self._entries > 2 * self._units + 64:
            self._buckets.clear()
            self._versions.clear()
            for source, queue in self._queues.items():
                for live in queue.values():
                    self._bucket(live.min_version).append((live.seq, source))
            self._entries = self._units

    def _bucket(self, version: int) -> list[tuple[int, str]]:
        bucket = self._buckets.get(version)
        if bucket is None:
            bucket = self._buckets[version] = []
            heapq.heappush(self._versions, version)
        return bucket

    def units(self, source: str) -> int:
        return len(self._queues[source])

    def head(self, source: str) -> Iterator[Unit]:
        """The ready units of ``source``, oldest first (do not change the pool while iterating)."""
        return iter(self._queues[source].values())

    def prefix_size(self, source: str, count: int) -> int:
        """Trajectories in the ``count`` oldest ready units of ``source``."""
        return sum(u.size for u in itertools.islice(self.head(source), count))

    def take(self, counts: dict[str, int]) -> list[Unit]:
        """Remove and return the ``counts[source]`` oldest units of each source."""
        taken: list[Unit] = []
        for source, count in counts.items():
            queue = self._queues[source]
            for _ in range(count):
                unit = queue.popitem(last=False)[1]
                self.ready[source] -= unit.size
                self.total -= unit.size
                self._units -= 1
                taken.append(unit)
        taken.sort(key=lambda u: u.seq)
        return taken

    def expire_older_than(self, version: int) -> list[Unit]:
        """Remove and return every unit whose oldest token's version is below ``version``."""
        expired: list[Unit] = []
        while self._versions and self._versions[0] < version:
            for seq, source in self._buckets.pop(heapq.heappop(self._versions)):
                self._entries -= 1
                unit = self._queues[source].pop(seq, None)
                if unit is not None:  # else it was taken already (NOTE [ Lazy version buckets ])
                    self.ready[source] -= unit.size
                    self.total -= unit.size
                    self._units -= 1
                    expired.append(unit)
        return expired

    def clear(self) -> list[Unit]:
        """Remove and return every unit."""
        dropped = [u for q in self._queues.values() for u in q.values()]
        for queue in self._queues.values():
            queue.clear()
        self._buckets.clear()
        self._versions.clear()
        self._entries = self._units = self.total = 0
        for source in self.ready:
            self.ready[source] = 0
        return dropped
