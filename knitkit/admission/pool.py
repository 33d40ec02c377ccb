"""The ready pool: accepted, not yet admitted units in one FIFO queue per source, with counters."""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from knitkit.types import TrajectoryMeta

COLUMNS = ("trajectory_id", "sample_id", "source", "rollout_step", "num_tokens", "min_version",
           "max_version", "accepted", "multimodal")  # fmt: skip
"""``TrajectoryMeta``'s fields, in its order: the columns of ``Rows`` and of a saved state."""


@dataclass(frozen=True, slots=True, eq=False)
class Rows:
    """Trajectory metadata as checked columns (one list per field of ``COLUMNS``, multimodal as
    a tuple per row), as a saved state's pool is restored: rows become ``TrajectoryMeta``
    objects only when a unit on them is admitted, dropped or inspected (NOTE [ Restored pool
    kept as columns ])."""

    columns: tuple[list[Any], ...]

    def metas(self, start: int, stop: int) -> tuple[TrajectoryMeta, ...]:
        """Rows ``[start, stop)`` as metadata (their fields were checked when the rows were read)."""
        return tuple(map(TrajectoryMeta, *(column[start:stop] for column in self.columns)))


# NOTE [ Restored pool kept as columns ]: a million pending trajectories used to load as a
# million frozen ``TrajectoryMeta`` objects (about 1.5 us each, with their units, the pool's
# tables and the collector's scan of them all: 2.4-3.3 s of CPU), although admission reads
# only each unit's source, size, sequence number and oldest version until it takes the unit.
# So a loaded pool keeps the state's checked columns (``Rows``, one block shared by every
# restored unit) and each restored unit its first row; the unit makes its metadata on first
# use of ``trajectories`` (admitted, expired, discarded, or a user reading the pool), O(its
# size), and keeps it. Every check on load still covers every row (restore.py reads the
# columns, vectorised where the pool is large). A snapshot encodes a run of restored units
# lying back to back in one block as slices of its columns, so a resumed job's next
# checkpoint is as cheap as the load and materialises nothing. At 1M pending in groups of 8
# (``benchmarks/checkpoint.py --admission-only``) the load, JSON parse included, takes
# 0.72-0.78 s of CPU, of which the parse 0.24, the id set 0.12, the column checks 0.11.
@dataclass(slots=True, eq=False)
class Unit:
    """What admission moves atomically: one trajectory, or a whole GRPO group when groups are
    atomic. Built from metadata (``Unit.of``) or on rows of a restored block (NOTE
    [ Restored pool kept as columns ])."""

    seq: int
    """Completion order across all sources (smaller is older)."""
    source: str
    size: int
    """Its trajectories."""
    min_version: int
    """Oldest version any of its tokens was generated with."""
    rows: Rows | None = None
    """The restored block it lies in (rows ``start`` to ``start + size``), or None."""
    start: int = 0
    metas: tuple[TrajectoryMeta, ...] | None = None

    @classmethod
    def of(cls, seq: int, source: str, trajectories: tuple[TrajectoryMeta, ...]) -> Unit:
        """A unit of ``trajectories`` (metadata already made)."""
        oldest = min(t.min_version for t in trajectories)
        return cls(seq, source, len(trajectories), oldest, None, 0, trajectories)

    @property
    def trajectories(self) -> tuple[TrajectoryMeta, ...]:
        metas = self.metas
        if metas is None:
            assert self.rows is not None  # built by ``of`` or on rows, never neither
            metas = self.metas = self.rows.metas(self.start, self.start + self.size)
        return metas


class ReadyPool:
    """Per-source FIFO queues of ready units; counts are kept so readiness checks are O(#sources).

    Selection only ever takes a prefix of each source's queue (oldest-first within a source), so
    a candidate is fully described by a count of units per source. With ``track_versions`` units
    are also bucketed by their oldest version, so ``expire_older_than`` costs O(expired), not
    O(pending), and no call ever does more than its own units' work (NOTE [ Version buckets
    without rebuilds ]).
    """

    __slots__ = ("_buckets", "_queues", "_versions", "ready", "total")

    def __init__(self, sources: Iterable[str], *, track_versions: bool = True) -> None:
        self._queues: dict[str, OrderedDict[int, Unit]] = {s: OrderedDict() for s in sources}
        self._buckets: dict[int, dict[int, str]] | None = {} if track_versions else None
        """oldest version -> {seq: source} of exactly its ready units (``None``: not tracked)."""
        self._versions: list[int] = []
        """Min-heap of the bucket keys, each once."""
        self.ready: dict[str, int] = dict.fromkeys(self._queues, 0)
        """Ready trajectories per source (sum of unit sizes)."""
        self.total = 0
        """Ready trajectories over all sources."""

    # NOTE [ Version buckets without rebuilds ]: a unit's bucket entry is removed when the unit
    # leaves the pool (taken or expired): O(1) per unit, so the buckets never hold dead
    # entries and never need a sweep. (An earlier version kept taken units' entries and rebuilt
    # every bucket when dead ones outnumbered live ones: amortised O(1), but one report() in
    # ~1M paid the whole O(pending) rebuild, 0.9 s at 1M pending.) An emptied bucket stays
    # until expiry pops its version, so each version enters the heap once; the buckets number
    # at most the distinct versions not yet expired (the staleness window when the controller
    # expires at every train batch). Per call: push O(log #versions), take O(units taken),
    # expire O(units expired + versions popped). What is left above that is CPython's own
    # table resize when a queue or bucket dict has taken ~0.4x its size in inserts: a C-level
    # copy of the pending units in it, about 40-70 ms per million (measured standalone; the
    # rebuild it replaces was a Python loop, 0.9 s at 1M). See benchmarks/admission.py
    # --families for the slowest single call at 1k/100k/1M pending.

    def __len__(self) -> int:
        return self.total

    def push(self, unit: Unit) -> None:
        self._queues[unit.source][unit.seq] = unit
        self.ready[unit.source] += unit.size
        self.total += unit.size
        if self._buckets is not None:
            version = unit.min_version
            bucket = self._buckets.get(version)
            if bucket is None:
                bucket = self._buckets[version] = {}
                heapq.heappush(self._versions, version)
            bucket[unit.seq] = unit.source

    def fill(self, units: list[Unit]) -> None:
        """Push ``units``, each source's in completion order, into this empty pool, in C-level
        passes (a restored pool of a million units; ``push`` one by one costs ~2 us each)."""
        if self.total:
            raise RuntimeError("fill() takes an empty pool")
        for source, run in itertools.groupby(units, attrgetter("source")):
            members = list(run)
            self._queues[source].update(zip(map(attrgetter("seq"), members), members, strict=True))
            size = sum(map(attrgetter("size"), members))
            self.ready[source] += size
            self.total += size
        if self._buckets is not None:
            for version, run in itertools.groupby(
                sorted(units, key=attrgetter("min_version")), attrgetter("min_version")
            ):
                members = list(run)
                self._buckets[version] = dict(
                    zip(
                        map(attrgetter("seq"), members),
                        map(attrgetter("source"), members),
                        strict=True,
                    )
                )
                heapq.heappush(self._versions, version)

    def units(self, source: str) -> int:
        return len(self._queues[source])

    def head(self, source: str) -> Iterator[Unit]:
        """The ready units of ``source``, oldest first (do not change the pool while iterating)."""
        return iter(self._queues[source].values())

    def queues(self) -> list[list[Unit]]:
        """Each source's ready units, oldest first: copies, O(units) (for a snapshot)."""
        return [list(q.values()) for q in self._queues.values()]

    def prefix_size(self, source: str, count: int) -> int:
        """Trajectories in the ``count`` oldest ready units of ``source``."""
        return sum(u.size for u in itertools.islice(self.head(source), count))

    def take(self, counts: dict[str, int]) -> list[Unit]:
        """Remove and return the ``counts[source]`` oldest units of each source."""
        taken: list[Unit] = []
        buckets = self._buckets
        for source, count in counts.items():
            queue = self._queues[source]
            for _ in range(count):
                unit = queue.popitem(last=False)[1]
                self.ready[source] -= unit.size
                self.total -= unit.size
                if buckets is not None:
                    del buckets[unit.min_version][unit.seq]
                taken.append(unit)
        taken.sort(key=lambda u: u.seq)
        return taken

    def expire_older_than(self, version: int) -> list[Unit]:
        """Remove and return every unit whose oldest token's version is below ``version``,
        oldest first (in completion order, however the pool was filled)."""
        if self._buckets is None:
            raise RuntimeError("this pool does not track versions (track_versions=False)")
        expired: list[Unit] = []
        while self._versions and self._versions[0] < version:
            for seq, source in self._buckets.pop(heapq.heappop(self._versions)).items():
                unit = self._queues[source].pop(seq)
                self.ready[source] -= unit.size
                self.total -= unit.size
                expired.append(unit)
        expired.sort(key=lambda u: u.seq)
        return expired

    def clear(self) -> list[Unit]:
        """Remove and return every unit."""
        dropped = [u for q in self._queues.values() for u in q.values()]
        for queue in self._queues.values():
            queue.clear()
        if self._buckets is not None:
            self._buckets.clear()
        self._versions.clear()
        self.total = 0
        for source in self.ready:
            self.ready[source] = 0
        return dropped
