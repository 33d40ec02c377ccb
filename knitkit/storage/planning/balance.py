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
    parts = karmarkar_karp_parts(costs, k, equal_size=equal_size)
    items = np.argsort(parts, kind="stable")
    return _split(items, np.bincount(parts, minlength=k))


def karmarkar_karp_parts(
    costs: Sequence[float] | np.ndarray, k: int, *, equal_size: bool = False
) -> np.ndarray:
    """``karmarkar_karp`` as the set (0 .. k-1) of every item, an int64 array."""
    if k < 1:
        raise ValueError(f"karmarkar_karp needs k >= 1, got {k}")
    values = np.asarray(costs, dtype=np.float64)
    n = len(values)
    # Differencing without sets: a heap entry is (spread key, tiebreak, its k sums in
    # descending order); keys are unique (tiebreak), so the pops do not depend on how the heap
    # was built. Merging needs only the sums: the loop logs the two merged entries (their
    # tiebreaks name them) and their sums before sorting, and ``_parts`` recovers the sets once
    # at the end from each merge's stable descending order, which is how it paired the sets.
    if equal_size:
        order = np.argsort(values, kind="stable")
        seeds = np.concatenate([np.full(-n % k, -1, dtype=np.int64), order]).reshape(-1, k)
        seeds = seeds[:, ::-1]  # each leaf: k items, one per set, heaviest first
        rows = np.where(seeds >= 0, values[seeds], 0.0).tolist()
        heap = [(sums[-1] - sums[0], leaf * k, sums) for leaf, sums in enumerate(rows)]
    else:
        seeds = np.full((n, k), -1, dtype=np.int64)
        seeds[:, 0] = np.arange(n)
        zeros = [0.0] * (k - 1)
        heap = [(-cost, i, [cost, *zeros]) for i, cost in enumerate(values.tolist())]
    heapq.heapify(heap)
    leaves = len(heap)
    first_merge = n + leaves
    tiebreak = first_merge
    merged: list[int] = []
    sums_log: list[float] = []
    add = operator.add
    while len(heap) > 1:
        _, a, sums_a = heapq.heappop(heap)
        _, b, sums_b = heap[0]
        sums = list(map(add, sums_a, reversed(sums_b)))
        sums_log += sums
        merged += (a, b)
        sums.sort(reverse=True)
        tiebreak += 1
        heapq.heapreplace(heap, (sums[-1] - sums[0], tiebreak, sums))
    # Entry e (the leaves, then the merges in order) owns positions e*k .. e*k+k-1.
    steps = len(merged) // 2
    tiebreaks = np.array(merged, dtype=np.int64).reshape(steps, 2)
    leaf = tiebreaks // k if equal_size else tiebreaks
    entries = np.where(tiebreaks > first_merge, leaves + tiebreaks - first_merge - 1, leaf)
    order = np.argsort(-np.array(sums_log).reshape(steps, k), axis=1, kind="stable")
    return _parts(seeds, k, entries, order)


def _parts(seeds: np.ndarray, k: int, entries: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The final set of each item, from ``karmarkar_karp_parts``' log of merges.

    Merge m (entry ``leaves + m``) put position ``order[m, p]`` of its first entry and
    ``k-1-order[m, p]`` of its second under its own position p; pointer jumping follows every
    leaf position up to a position of the last entry, whose index is the set.
    """
    leaves, steps = len(seeds), len(order)
    total = (leaves + steps) * k
    parent = np.arange(total, dtype=np.int64)
    own = (leaves + np.arange(steps, dtype=np.int64))[:, None] * k + np.arange(k)
    parent[entries[:, :1] * k + order] = own
    parent[entries[:, 1:] * k + (k - 1 - order)] = own
    while True:
        jumped = parent[parent]
        if np.array_equal(jumped, parent):
            break
        parent = jumped
    items = seeds.reshape(-1)
    real = items >= 0
    parts = np.empty(real.sum(), dtype=np.int64)
    parts[items[real]] = parent[: leaves * k][real] - (total - k)
    return parts


def pack_by_budget(tokens: Sequence[int], count: int, budget: int | None) -> list[list[int]] | None:
    """Split items into exactly ``count`` bins of at most ``budget`` tokens, balancing tokens.

    Worst-fit decreasing: each item (largest first) joins the lightest bin. An item larger than
    the budget may sit alone in a bin. Returns ``None`` when the items do not fit ``count`` bins;
    bins may be empty when there are fewer items than bins. Each bin is sorted.
    """
    matrix = _ragged([tokens])
    bins = _worst_fit(matrix, count, budget)
    return None if bins is None else _bin_lists(matrix, bins, count)[0]


def pack_ranks_by_budget(
    tokens_per_rank: Sequence[Sequence[int]], budget: int | None, min_count: int = 1
) -> list[list[list[int]]]:
    """Micro-batches for every rank with the SAME count on all ranks, each within ``budget``.

    The count starts at a lower bound (``min_count``; per rank ``ceil(tokens / budget)`` and the
    number of items above half the budget, no two of which share a bin) and grows until every
    rank's items fit; it never exceeds the largest item count (one item each always fits).
    """
    matrix = _ragged(tokens_per_rank)
    count, bins = pack_ranks(matrix, budget, min_count)
    return _bin_lists(matrix, bins, count)


def pack_ranks(
    matrix: np.ndarray, budget: int | None, min_count: int = 1
) -> tuple[int, np.ndarray]:
    """``pack_ranks_by_budget`` on a ``[ranks, items]`` token matrix padded with -1 after each
    rank's items: the common micro-batch count and every item's bin (-1 for padding)."""
    count = max(1, min_count)
    if budget is not None and matrix.size:
        tokens = np.maximum(matrix, 0)
        count = max(
            count,
            int((-(-tokens.sum(axis=1) // budget)).max()),
            int((2 * tokens > budget).sum(axis=1).max()),
        )
    while True:
        bins = _worst_fit(matrix, count, budget)
        if bins is not None:
            return count, bins
        count += 1


def _worst_fit(matrix: np.ndarray, count: int, budget: int | None) -> np.ndarray | None:
    """Every rank's worst-fit decreasing packing into ``count`` bins at once (``pack_by_budget``
    row by row): step t places each rank's t-th largest item (ties by index) into its lightest
    bin (ties to the lowest); ``None`` if any rank's items do not fit. Padding items weigh 0 and
    are never refused, so a failing rank only spoils its own later steps, and the whole attempt
    is refused after the loop."""
    ranks, width = matrix.shape
    order = np.argsort(-matrix, axis=1, kind="stable")  # padding (-1) sorts last
    sizes = np.take_along_axis(matrix, order, axis=1).T.copy()  # [step, rank], contiguous steps
    weights = np.maximum(sizes, 0)
    loads = np.zeros((ranks, count), dtype=np.int64)
    flat = loads.reshape(-1)
    offsets = np.arange(ranks, dtype=np.int64) * count
    targets = np.empty((width, ranks), dtype=np.int64)
    before = np.empty((width, ranks), dtype=np.int64)
    for step in range(width):
        target = loads.argmin(axis=1)
        target += offsets
        load = flat[target]
        flat[target] = load + weights[step]
        targets[step] = target
        before[step] = load
    if budget is not None and ((before > 0) & (before + sizes > budget) & (sizes >= 0)).any():
        return None
    bins = np.empty_like(matrix)
    np.put_along_axis(bins, order, (targets - offsets).T, axis=1)
    bins[matrix < 0] = -1
    return bins


def _ragged(tokens_per_rank: Sequence[Sequence[int]]) -> np.ndarray:
    """Ragged token lists as a ``[ranks, items]`` int64 matrix, padded with -1."""
    width = max(map(len, tokens_per_rank), default=0)
    matrix = np.full((len(tokens_per_rank), width), -1, dtype=np.int64)
    for row, tokens in zip(matrix, tokens_per_rank, strict=True):
        row[: len(tokens)] = tokens
    return matrix


def _bin_lists(matrix: np.ndarray, bins: np.ndarray, count: int) -> list[list[list[int]]]:
    """Per rank, per bin, the sorted indices of the items ``bins`` puts there."""
    rank, item = np.nonzero(matrix >= 0)
    key = rank * count + bins[rank, item]
    key_count = len(matrix) * count
    flat = _split(item[np.argsort(key, kind="stable")], np.bincount(key, minlength=key_count))
    return [flat[r * count : (r + 1) * count] for r in range(len(matrix))]


def _split(values: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """``values`` cut into consecutive lists of ``counts`` items."""
    listed = values.tolist()
    stops = np.cumsum(counts)
    return [listed[a:b] for a, b in zip((stops - counts).tolist(), stops.tolist(), strict=True)]
