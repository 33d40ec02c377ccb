"""The planner: from metadata alone, DP balance, CP split, micro-batches and encoder assignment."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import attrgetter

import numpy as np

from knitkit.collector import collector_paused
from knitkit.storage.planning.balance import CostModel, karmarkar_karp_parts, pack_ranks
from knitkit.storage.planning.columns import MetaColumns
from knitkit.storage.planning.cp import chunks_by_rank, padded_lengths
from knitkit.storage.planning.plan import (
    ConsumerPlan,
    EncoderPlan,
    EncoderRankPlan,
    EncoderTopology,
    MicroBatchPlan,
    MiniBatchPlan,
    SequenceSlice,
    StageLayers,
    Topology,
    build_many,
)
from knitkit.types import MultimodalRef, TrajectoryMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    """How a mini-batch is cut for its consumers (topologies are passed separately)."""

    token_fields: tuple[str, ...] = ("tokens", "logprobs", "loss_mask")
    """Per-token fields every consumer reads for its sequence ranges."""
    scalar_fields: tuple[str, ...] = ("reward",)
    """Per-trajectory fields every CP rank of the owning DP rank reads whole."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of one micro-batch on one consumer (this CP rank's padded tokens);
    ``None`` packs each DP rank's share into ``min_micro_batches`` micro-batches."""
    min_micro_batches: int = 1
    cost: CostModel = field(default_factory=CostModel)
    keep_groups: bool = False
    """Keep the trajectories of one GRPO sample (``sample_id``) on one DP rank."""
    encoder_max_cost_per_micro_batch: float | None = None
    """Cost budget of one encoder micro-batch; ``None``: one encoder micro-batch per rank."""
    pad_multiple: int = 1
    """Extra padding: each CP chunk (the whole sequence at CP=1) becomes a multiple of this, i.e.
    sequences are padded to ``topology.pad_multiple * pad_multiple``; 16 for FP8 under
    Transformer Engine."""
    stage_layers: StageLayers | None = None
    """Pipeline stages' layers of layer-indexed fields (e.g. MoE routing): each stage's ring
    reads only its layers (NOTE [ One ring per pipeline stage ]); ``None``: fields go whole."""

    def __post_init__(self) -> None:
        budgets = {
            "max_tokens_per_micro_batch": self.max_tokens_per_micro_batch,
            "encoder_max_cost_per_micro_batch": self.encoder_max_cost_per_micro_batch,
        }
        for name, value in budgets.items():
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"PlannerConfig.{name}={value!r} must be > 0 (or None)")
        if isinstance(self.min_micro_batches, bool) or not (
            isinstance(self.min_micro_batches, int) and self.min_micro_batches >= 1
        ):
            raise ValueError(
                f"PlannerConfig.min_micro_batches={self.min_micro_batches!r} must be an int >= 1"
            )
        if self.stage_layers is not None and not isinstance(self.stage_layers, StageLayers):
            raise TypeError(
                f"PlannerConfig.stage_layers={self.stage_layers!r} must be a StageLayers or None"
            )
        if isinstance(self.pad_multiple, bool) or not (
            isinstance(self.pad_multiple, int) and self.pad_multiple >= 1
        ):
            raise ValueError(
                f"PlannerConfig.pad_multiple={self.pad_multiple!r} must be an int >= 1 (16 for FP8)"
            )


def plan_minibatch(
    metas: Sequence[TrajectoryMeta],
    topology: Topology,
    config: PlannerConfig | None = None,
    encoders: Sequence[EncoderTopology] = (),
    minibatch_id: str = "",
) -> MiniBatchPlan:
    """Assign an admitted mini-batch's trajectories to every (DP, CP) consumer and encoder rank.

    Trajectories with ``accepted=False`` are dropped. Every DP rank gets the same number of
    micro-batches; every real token lands on exactly one (DP, CP) consumer.
    """
    with collector_paused():  # see NOTE [ Planner and the garbage collector ]
        return _plan(metas, topology, config or PlannerConfig(), encoders, minibatch_id)


# NOTE [ Planner and the garbage collector ]: a plan is some 4 tracked objects per
# (trajectory, CP rank) (a slice and its chunk tuples), 130k at DP128 x CP2 with 16k
# trajectories, none in a cycle. With the collector on, every 700 allocations would rescan
# the young ones and, in a small heap, whole-heap collections would rescan the plan built so
# far (up to half the planner's time at 16k in a fresh interpreter). Paused, the collector
# scans them once, at the first allocation after the call (at most one young-generation
# pass, a few ms at 16k; less when an older plan was freed meanwhile, as freeing lowers the
# count): the caller pays that, and ``planner_ms`` counts it. The collector's switch is
# process-wide, so the pause is one process-wide count under a lock: the first planner in
# pauses it, the last one out switches it back on if it was on, so no planner runs with it on
# and threads planning at once never leave it off; a collector that was off when the first
# planner went in stays off (one switched off while planners run is switched back on: the
# switch does not say who turned it). Other threads' garbage waits for the pause too. The
# count is ``knitkit.collector``'s, shared with admission's state load
# (NOTE [ Loading with the collector paused ]). Process-wide state: docs/lifecycle.md.


def _plan(
    metas: Sequence[TrajectoryMeta],
    topology: Topology,
    config: PlannerConfig,
    encoders: Sequence[EncoderTopology],
    minibatch_id: str,
) -> MiniBatchPlan:
    _check_layout(topology, config, encoders)
    columns = MetaColumns.of(metas)
    lengths = np.array(columns.num_tokens, dtype=np.int64)
    padded = padded_lengths(lengths, topology.pad_multiple * config.pad_multiple)
    ranks = _balance_dp(columns, config.cost(lengths), topology.dp, config.keep_groups)
    count, order, sizes = _micro_batches(
        ranks,
        padded // topology.cp,
        topology.dp,
        config.max_tokens_per_micro_batch,
        config.min_micro_batches,
    )
    consumers = _consumers(columns, padded, order, sizes, count, topology, config)
    encoder_plans = tuple(
        _plan_encoder(columns.multimodal, e, config.encoder_max_cost_per_micro_batch)
        for e in encoders
    )
    return MiniBatchPlan(minibatch_id, topology, consumers, encoder_plans, config.stage_layers)


def _check_layout(
    topology: Topology, config: PlannerConfig, encoders: Sequence[EncoderTopology]
) -> None:
    """The planner's non-metadata inputs, checked before any work (``TypeError`` / ``ValueError``
    naming the argument): values are validated at construction, so only types and the
    encoders' names (they name consumers, so they must be unique) are left."""
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
    if not isinstance(config, PlannerConfig):
        raise TypeError(f"config must be a PlannerConfig, got {type(config).__name__}")
    for what in ("token_fields", "scalar_fields"):
        value = getattr(config, what)
        if not isinstance(value, tuple) or not all(isinstance(f, str) and f for f in value):
            raise TypeError(
                f"PlannerConfig.{what}={value!r} must be a tuple of field names, e.g. ('tokens',)"
            )
    both = sorted(set(config.token_fields) & set(config.scalar_fields))
    if both:
        raise ValueError(f"fields {both} are both per-token and scalar in the PlannerConfig")
    names = []
    for encoder in encoders:
        if not isinstance(encoder, EncoderTopology):
            raise TypeError(f"encoders must be EncoderTopology values, got {encoder!r}")
        names.append(encoder.name)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"encoders {twice} are given twice; each encoder needs its own name (it names its "
            "consumers '<name>/dp<r>')"
        )


def _balance_dp(columns: MetaColumns, costs: np.ndarray, dp: int, keep_groups: bool) -> np.ndarray:
    """Each trajectory's DP rank: KK with equal set sizes, over trajectories or GRPO groups."""
    if not keep_groups:
        return karmarkar_karp_parts(costs, dp, equal_size=True)
    samples = columns.sample_ids
    code = {sample: i for i, sample in enumerate(dict.fromkeys(samples))}  # first-seen order
    groups = np.fromiter(map(code.__getitem__, samples), dtype=np.int64, count=len(samples))
    group_costs = np.bincount(groups, weights=costs, minlength=len(code))
    return karmarkar_karp_parts(group_costs, dp, equal_size=True)[groups]


def _micro_batches(
    ranks: np.ndarray, tokens: np.ndarray, dp: int, budget: int | None, min_count: int
) -> tuple[int, np.ndarray, np.ndarray]:
    """Pack every rank's items (ascending) into the same number of micro-batches of at most
    ``budget`` tokens (``pack_ranks_by_budget``); ``ranks[i]`` is item i's rank.

    Returns that count, the items in plan order (rank, micro-batch, ascending index) and the
    number of items of each of the ``dp * count`` micro-batches, rank-major.
    """
    by_rank = np.argsort(ranks, kind="stable")
    rank = ranks[by_rank]
    per_rank = np.bincount(ranks, minlength=dp)
    position = np.arange(len(rank)) - np.repeat(np.cumsum(per_rank) - per_rank, per_rank)
    matrix = np.full((dp, int(per_rank.max(initial=0))), -1, dtype=np.int64)
    matrix[rank, position] = tokens[by_rank]
    count, bins = pack_ranks(matrix, budget, min_count)
    batch = rank * count + bins[rank, position]
    order = by_rank[np.argsort(batch, kind="stable")]
    return count, order, np.bincount(batch, minlength=dp * count)


def _consumers(
    columns: MetaColumns,
    padded: np.ndarray,
    order: np.ndarray,
    sizes: np.ndarray,
    count: int,
    topology: Topology,
    config: PlannerConfig,
) -> tuple[ConsumerPlan, ...]:
    """Every (DP, CP) consumer's micro-batches, DP-major, from the trajectories in plan order and
    the micro-batch sizes, built column-wise (``build_many``): one ``SequenceSlice`` per
    (trajectory, CP rank) is the planner's main cost."""
    seq = order.tolist()
    ids = list(map(columns.trajectory_ids.__getitem__, seq))
    tokens = list(map(columns.num_tokens.__getitem__, seq))
    multimodal = list(map(columns.multimodal.__getitem__, seq))
    lengths = padded[order]
    padded_list = lengths.tolist()
    cuts = _cuts(sizes)
    index = list(range(count)) * topology.dp
    fields = (repeat(config.token_fields), repeat(config.scalar_fields), repeat(()))
    by_cp = []
    for chunks in chunks_by_rank(lengths, topology.cp):
        slices = build_many(SequenceSlice, len(seq), ids, tokens, padded_list, chunks, multimodal)
        sequences = map(tuple, map(slices.__getitem__, cuts))
        by_cp.append(build_many(MicroBatchPlan, len(cuts), index, sequences, *fields))
    consumers: list[ConsumerPlan] = []
    for dp_rank in range(topology.dp):
        for cp_rank, micro_batches in enumerate(by_cp):
            mine = tuple(micro_batches[dp_rank * count : (dp_rank + 1) * count])
            consumers.append(ConsumerPlan(dp_rank, cp_rank, mine))
    return tuple(consumers)


def plan_encoder(
    metas: Sequence[TrajectoryMeta],
    encoder: EncoderTopology,
    max_cost_per_micro_batch: float | None = None,
) -> EncoderPlan:
    """Balance the mini-batch's UNIQUE multimodal units of ``encoder.kinds`` over its DP ranks by cost.

    Independent of the backbone: a unit shared by n trajectories is encoded once, on one rank.
    A unit's cost is ``MultimodalRef.cost``, or its token count when the cost is 0.
    """
    multimodal = list(map(attrgetter("multimodal"), metas))
    return _plan_encoder(multimodal, encoder, max_cost_per_micro_batch)


def _plan_encoder(
    multimodal: Sequence[tuple[MultimodalRef, ...]],
    encoder: EncoderTopology,
    max_cost_per_micro_batch: float | None,
) -> EncoderPlan:
    """``plan_encoder`` on the mini-batch's multimodal column."""
    refs = list(chain.from_iterable(multimodal))
    keys = list(map(attrgetter("key"), refs))
    kinds = list(map(attrgetter("field"), keys))
    wanted = list(map(encoder.kinds.__contains__, kinds))
    if not all(wanted):
        refs, keys, kinds = (list(compress(c, wanted)) for c in (refs, keys, kinds))
    # Keyed by (owner, field) tuples: UnitKey's own order and equality, hashed in C; filled
    # backwards so each unit keeps its first reference.
    pairs = list(zip(map(attrgetter("owner"), keys), kinds, strict=True))
    first = dict(zip(reversed(pairs), reversed(refs), strict=True))
    unique = list(map(first.__getitem__, sorted(first)))
    cost = np.fromiter(map(attrgetter("cost"), unique), dtype=np.float64, count=len(unique))
    tokens = np.fromiter(map(attrgetter("num_tokens"), unique), dtype=np.float64, count=len(unique))
    cost = np.where(cost != 0, cost, tokens)
    keys = list(map(attrgetter("key"), unique))
    parts = karmarkar_karp_parts(cost, encoder.dp)
    budget = None if max_cost_per_micro_batch is None else math.ceil(max_cost_per_micro_batch)
    whole = np.ceil(cost).astype(np.int64)
    count, order, sizes = _micro_batches(parts, whole, encoder.dp, budget, 1)
    planned = list(map(keys.__getitem__, order.tolist()))
    batches = [tuple(planned[cut]) for cut in _cuts(sizes)]
    ranks = tuple(
        EncoderRankPlan(encoder.name, r, tuple(batches[r * count : (r + 1) * count]))
        for r in range(encoder.dp)
    )
    return EncoderPlan(encoder, ranks)


def _cuts(sizes: np.ndarray) -> list[slice]:
    """Slices cutting a sequence into consecutive runs of ``sizes`` items."""
    stops = np.cumsum(sizes)
    return list(map(slice, (stops - sizes).tolist(), stops.tolist()))
