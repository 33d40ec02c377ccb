"""Feasibility guards (paper eq. 4): a candidate must leave every quota group's deficit coverable."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from knitkit.admission.pool import ReadyPool
from knitkit.admission.selection import CandidateRequest


def guard_coverable(
    group_lowers: Sequence[Sequence[tuple[str, int]]],
    admitted: Mapping[str, int],
    ready: Mapping[str, int],
    slots_after: int,
) -> bool:
    """O(#sources) precheck: the ready pool can supply what each group's guard needs now.

    A group needs ``sum_i (tau_i - a_i)^+ - slots_after`` of its deficit covered by this
    mini-batch; only ready trajectories of its deficit sources can cover it.
    """
    for group in group_lowers:
        need = cover = 0
        for source, lower in group:
            deficit = lower - admitted[source]
            if deficit > 0:
                need += deficit
                cover += min(deficit, ready[source])
        if need - slots_after > cover:
            return False
    return True


def candidate_admissible(
    counts: Mapping[str, int], request: CandidateRequest, pool: ReadyPool
) -> bool:
    """Check a proposal: exact size, upper bounds, and (if guarded) every group's guard Q_k.

    ``Q_k: sum_{i in G_k} (tau_i - b_{i,t})^+ <= tau_0 - b_{0,t}`` with ``b`` the train-batch
    counts once the candidate is admitted.
    """
    taken: dict[str, int] = {}
    for source, count in counts.items():
        if count < 0 or count > pool.units(source):
            return False
        taken[source] = pool.prefix_size(source, count)
    if sum(taken.values()) != request.size:
        return False
    if any(taken.get(s, 0) > room for s, room in request.room.items()):
        return False
    if request.guarded:
        for group in request.groups:
            deficit = sum(max(0, request.deficits[s] - taken.get(s, 0)) for s in group)
            if deficit > request.slots_after:
                return False
    return True
