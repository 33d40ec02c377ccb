"""Selection policies: propose the candidate mini-batch (units per source) from the ready pool."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from knitkit.admission.bounds import GroupBounds
from knitkit.admission.pool import ReadyPool, Unit


@dataclass(frozen=True, slots=True)
class CandidateRequest:
    """What the controller asks of a selection policy for the next mini-batch."""

    size: int
    """Trajectories the mini-batch must hold."""
    slots_after: int
    """Train-batch slots left once the candidate is admitted: ``tau_0 - b_{0,t}``."""
    bounds: Mapping[str, GroupBounds]
    """Per source quota (empty when quotas are only measured): its bounds in whole GRPO groups
    (see NOTE [ Bounds in whole groups ])."""
    admitted: Mapping[str, int]
    """Trajectories per source already admitted into the open train batch."""
    guarded: bool
    """True when the proposal must keep the feasibility guard (eq. 4) satisfiable: the deficits
    left after the candidate, summed over every source quota, fit in ``slots_after``."""

    @property
    def deficits(self) -> dict[str, int]:
        """Per quota'd source: what its lower bound (in whole groups) misses before the candidate."""
        return {s: b.deficit(self.admitted[s]) for s, b in self.bounds.items()}

    @property
    def room(self) -> dict[str, int]:
        """Per upper-bounded source: how many more trajectories it may contribute."""
        rooms = {s: b.room(self.admitted[s]) for s, b in self.bounds.items()}
        return {s: r for s, r in rooms.items() if r is not None}


@runtime_checkable
class SelectionPolicy(Protocol):
    """Proposes ``{source: units}`` (oldest units of each source) totalling ``request.size``, or None."""

    def propose(self, request: CandidateRequest, pool: ReadyPool) -> dict[str, int] | None: ...


@dataclass(frozen=True, slots=True)
class OldestFirst:
    """Default policy: oldest ready units first, skipping what the guard or upper bounds forbid."""

    def propose(self, request: CandidateRequest, pool: ReadyPool) -> dict[str, int] | None:
        return fill_oldest_first(request, pool, {})


@dataclass(frozen=True, slots=True)
class PacedSelection:
    """Give each deficit source its pace share of the mini-batch when ready, then fill oldest-first.

    A source's pace share is its remaining deficit times ``size / (size + slots_after)``: the
    share of the remaining train batch this mini-batch represents. Taking slow sources as soon
    as they complete keeps later mini-batches from waiting on them (and keeps mixes balanced).
    """

    def propose(self, request: CandidateRequest, pool: ReadyPool) -> dict[str, int] | None:
        share = request.size / (request.size + request.slots_after)
        start: dict[str, int] = {}
        room = request.room
        for source, deficit in request.deficits.items():
            want = min(math.ceil(deficit * share), room.get(source, deficit))
            taken = units = 0
            for unit in pool.head(source):
                if taken + unit.size > want:
                    break
                taken += unit.size
                units += 1
            if units:
                start[source] = units
        if sum(_sizes(pool, start).values()) > request.size:
            start = {}
        return fill_oldest_first(request, pool, start)


def _sizes(pool: ReadyPool, counts: Mapping[str, int]) -> dict[str, int]:
    return {s: pool.prefix_size(s, c) for s, c in counts.items()}


def fill_oldest_first(
    request: CandidateRequest,
    pool: ReadyPool,
    start: Mapping[str, int],
) -> dict[str, int] | None:
    """Extend ``start`` (units per source) oldest-first to ``request.size`` trajectories.

    With ``request.guarded``, a unit is skipped when taking it would leave fewer free slots than
    the outstanding deficits still need (so the guard of eq. 4 stays satisfiable).
    The slack (free slots minus what the guard still needs) never grows while filling, so a
    source skipped once stays skipped: a heap merge of the source heads, O(size x log #sources).
    """
    counts = dict(start)
    taken = _sizes(pool, counts)
    bounds, admitted = request.bounds, request.admitted
    deficit = {s: b.deficit(admitted[s] + taken.get(s, 0)) for s, b in bounds.items()}
    must = max(0, sum(deficit.values()) - request.slots_after) if request.guarded else 0
    total = sum(taken.values())

    cursors = {s: itertools.islice(pool.head(s), counts.get(s, 0), None) for s in pool.ready}
    current: dict[str, Unit] = {}

    def head(source: str) -> tuple[int, str] | None:
        unit = next(cursors[source], None)
        if unit is None:
            return None
        current[source] = unit
        return (unit.seq, source)

    heap = [h for h in map(head, pool.ready) if h is not None]
    heapq.heapify(heap)
    while total < request.size:
        free = request.size - total
        if must > free or not heap:
            return None
        source = heapq.heappop(heap)[1]
        unit = current[source]
        bound = bounds.get(source)
        have = admitted.get(source, 0) + taken.get(source, 0)
        if unit.size > free or (
            bound is not None and bound.usable(have + unit.size) < have + unit.size
        ):
            continue
        covers = min(unit.size, deficit.get(source, 0), must)
        if must - covers > free - unit.size:
            continue  # taking it would leave the guard unsatisfiable
        counts[source] = counts.get(source, 0) + 1
        taken[source] = taken.get(source, 0) + unit.size
        total += unit.size
        if bound is not None:
            deficit[source] = bound.deficit(have + unit.size)
        must -= covers
        nxt = head(source)
        if nxt is not None:
            heapq.heappush(heap, nxt)
    return counts
