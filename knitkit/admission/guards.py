"""Feasibility guard (paper eq. 4): a candidate must leave the whole train batch completable."""

from __future__ import annotations

from collections.abc import Mapping

from knitkit.admission.bounds import GroupBounds
from knitkit.admission.pool import ReadyPool
from knitkit.admission.selection import CandidateRequest

# NOTE [ One guard over every source quota ]: the paper checks one guard per group G_k of
# quotas "whose target classes compete for the same batch slots", e.g. all data-source quotas
# form one group; classes of different groups overlap (a trajectory counts once in each
# group), so their guards are independent. A ``SourceQuota``'s class is its source and every
# trajectory has exactly one source: all source quotas are classes of one partition and
# compete for the same slots, whatever ``group`` label they carry. Checking a guard per label
# let two labelled groups each fit the free slots while their sum did not, and the train batch
# deadlocked (issue 25: 4 slots left, a and b needing 4 each). So there is one guard,
# ``sum_i (tau_i - b_{i,t})^+ <= tau_0 - b_{0,t}`` over every source quota; with disjoint
# classes it is exact: whenever it holds, filling the free slots with each deficit source's
# missing trajectories meets every lower bound, and upper bounds cannot block the rest
# (construction checks that the bounds admit a full batch, and admission never passes one).
# Completion quotas and user predicates stay readiness conditions, never capacity guards.
# ``SourceQuota.group`` stays as a label (quota files written for the per-label guard still
# load, and now stay feasible).


def guard_coverable(
    bounds: Mapping[str, GroupBounds],
    admitted: Mapping[str, int],
    ready: Mapping[str, int],
    slots_after: int,
) -> bool:
    """O(#sources) precheck: the ready pool can supply what the guard needs from this mini-batch.

    The guard needs ``sum_i (tau_i - a_i)^+ - slots_after`` of the deficit covered now, with
    ``tau_i`` in whole groups (NOTE [ Bounds in whole groups ]); only ready trajectories of
    deficit sources can cover it (see NOTE [ One guard over every source quota ]).
    """
    need = cover = 0
    for source, bound in bounds.items():
        deficit = bound.deficit(admitted[source])
        if deficit > 0:
            need += deficit
            cover += min(deficit, ready[source])
    return need - slots_after <= cover


def candidate_admissible(
    counts: Mapping[str, int], request: CandidateRequest, pool: ReadyPool
) -> bool:
    """Check a proposal: exact size, upper bounds, and (if guarded) the feasibility guard Q.

    ``Q: sum_i (tau_i - b_{i,t})^+ <= tau_0 - b_{0,t}`` over every source quota, with ``b`` the
    train-batch counts once the candidate is admitted and the bounds in whole groups.
    """
    taken: dict[str, int] = {}
    for source, count in counts.items():
        if count < 0 or count > pool.units(source):
            return False
        taken[source] = pool.prefix_size(source, count)
    if sum(taken.values()) != request.size:
        return False
    deficit = 0
    for source, bound in request.bounds.items():
        after = request.admitted[source] + taken.get(source, 0)
        if bound.usable(after) < after:
            return False
        deficit += bound.deficit(after)
    return not request.guarded or deficit <= request.slots_after
