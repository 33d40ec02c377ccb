"""Workload balancing: the cost model, Karmarkar-Karp partitioning, and token-budget micro-batch packing."""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class CostModel:
    """Compute cost of a sequence of length L: ``linear * L + quadratic * L**2``.

    The defaults are verl's ``calculate_workload`` (24576 L + L^2: MLP/projection FLOPs of a
    hidden-4096 model against causal attention), in arbitrary units.
    """

    linear: float = 24576.0
    quadratic: float = 1.0

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.linear * lengths + self.quadratic * lengths * lengths


def karmarkar_karp(costs: Sequence[float], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Partition item indices into ``k`` sets of near-equal total cost (largest differencing method).

    With ``equal_size`` the set sizes differ by at most one (items are seeded ``k`` at a time in
    sorted order, as verl does for DP balancing); otherwise sizes are free. Each set is sorted.
    """
    if k < 1:
        raise ValueError(f"karmarkar_karp needs k >= 1, got {k}")
    n = len(costs)
    # A set is a tree of its merges (a list of items at a leaf, a pair of subtrees above),
    # flattened once at the end: merging is O(k) per step instead of copying every member.
    heap: list[tuple[float, int, list[float], list[_Members]]] = []
    if equal_size:
        order = np.argsort(np.asarray(costs, dtype=np.float64), kind="stable").tolist()
        order = [-1] * (-n % k) + order  # zero-cost placeholders, dropped at the end
        for start in range(0, len(order), k):
            chunk = order[start : start + k][::-1]
            sums = [float(costs[i]) if i >= 0 else 0.0 for i in chunk]
            seeded: list[_Members] = [[i] for i in chunk]
            heapq.heappush(heap, (sums[-1] - sums[0], start, sums, seeded))
    else:
        empty: list[_Members] = [[] for _ in range(k - 1)]
        zeros = [0.0] * (k - 1)
        for i, cost in enumerate(map(float, costs)):
            heap.append((-cost, i, [cost, *zeros], [[i], *empty]))
        heapq.heapify(heap)  # keys are unique (index tiebreak): same pops as pushing one by one
    tiebreak = n + len(heap)
    ranks = range(k)
    while len(heap) > 1:
        _, _, sums_a, sets_a = heapq.heappop(heap)
        _, _, sums_b, sets_b = heap[0]
        sums = list(map(operator.add, sums_a, reversed(sums_b)))
        order = sorted(ranks, key=sums.__getitem__, reverse=True)
        sets_b = sets_b[::-1]
        merged: list[_Members] = [_join(sets_a[j], sets_b[j]) for j in order]
        sums = list(map(sums.__getitem__, order))
        tiebreak += 1
        heapq.heapreplace(heap, (sums[-1] - sums[0], tiebreak, sums, merged))
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(i for i in _flatten(s) if i >= 0) for s in heap[0][3]]


_Members = list[int] | tuple["_Members", "_Members"]
"""One set of a partial Karmarkar-Karp solution: items at a leaf, merged sets as pairs."""


def _join(a: _Members, b: _Members) -> _Members:
    """The union of two sets; an empty side is dropped, so trees only hold real members."""
    return (a, b) if a and b else a or b


def _flatten(members: _Members) -> list[int]:
    out: list[int] = []
    stack = [members]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack.extend(node)
        else:
            out.extend(node)
    return out


def pack_by_budget(tokens: Sequence[int], count: int, budget: int | None) -> list[list[int]] | None:
    """Split items into exactly ``count`` bins of at most ``budget`` tokens, balancing tokens.

    Worst-fit decreasing: each item (largest first) joins the lightest bin. An item larger than
    the budget may sit alone in a bin. Returns ``None`` when the items do not fit ``count`` bins;
    bins may be empty when there are fewer items than bins. Each bin is sorted.
    """
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [(0, b) for b in range(count)]
    for i in sorted(range(len(tokens)), key=tokens.__getitem__, reverse=True):
        load, b = loads[0]
        size = tokens[i]
        if budget is not None and load > 0 and load + size > budget:
            return None
        bins[b].append(i)
        heapq.heapreplace(loads, (load + size, b))
    return [sorted(b) for b in bins]


def pack_ranks_by_budget(
    tokens_per_rank: Sequence[Sequence[int]], budget: int | None, min_count: int = 1
) -> list[list[list[int]]]:
    """Micro-batches for every rank with the SAME count on all ranks, each within ``budget``.

    The count starts at a lower bound (``min_count``; per rank ``ceil(tokens / budget)`` and the
    number of items above half the budget, no two of which share a bin) and grows until every
    rank's items fit; it never exceeds the largest item count (one item each always fits).
    """
    count = max(1, min_count)
    if budget is not None:
        for tokens in tokens_per_rank:
            halves = sum(1 for t in tokens if 2 * t > budget)
            count = max(count, -(-sum(tokens) // budget), halves)
    while True:
        packed = [pack_by_budget(tokens, count, budget) for tokens in tokens_per_rank]
        if all(p is not None for p in packed):
            return [p for p in packed if p is not None]
        count += 1
