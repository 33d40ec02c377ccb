"""Plan values: which unit ranges every consumer reads, micro-batch by micro-batch, and how to pack them."""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from knitkit.types import FieldView, MultimodalRef, SeqRange, UnitKey, UnitRead, slot_setters

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T", bound="DataclassInstance")


@dataclass(frozen=True, slots=True)
class Topology:
    """Backbone consumer layout: DP x CP x TP ranks, CP using Megatron's load-balanced 2*cp chunks."""

    dp: int
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    """With sequence parallelism every CP chunk must also split evenly over TP ranks."""

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp"):
            _check_size(f"Topology.{name}", getattr(self, name))
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"Topology.sequence_parallel={self.sequence_parallel!r} must be True or False"
            )

    @property
    def pad_multiple(self) -> int:
        """Every sequence is padded to a multiple of this (Megatron's tp*cp*2 / cp*2 / tp rule)."""
        multiple = 2 * self.cp if self.cp > 1 else 1
        return multiple * self.tp if self.sequence_parallel else multiple


@dataclass(frozen=True, slots=True)
class EncoderTopology:
    """One multimodal encoder's own layout, independent of the backbone's."""

    name: str
    """Encoder name, e.g. "vision"; consumers of its plan are named ``"<name>/dp<r>"``."""
    dp: int
    tp: int = 1
    kinds: tuple[str, ...] = ("image", "video")
    """Multimodal unit kinds (``UnitKey.field``) this encoder consumes."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(
                f"EncoderTopology.name={self.name!r} must be a non-empty string without '/' "
                "(its consumers are named '<name>/dp<r>')"
            )
        _check_size(f"EncoderTopology({self.name!r}).dp", self.dp)
        _check_size(f"EncoderTopology({self.name!r}).tp", self.tp)
        kinds = self.kinds
        if isinstance(kinds, list):
            kinds = tuple(kinds)
            object.__setattr__(self, "kinds", kinds)
        if (
            not isinstance(kinds, tuple)
            or not kinds
            or not all(isinstance(k, str) and k for k in kinds)
        ):
            raise ValueError(
                f"EncoderTopology({self.name!r}).kinds={kinds!r} must be a non-empty tuple of "
                "multimodal kinds such as ('image', 'video')"
            )


def _check_size(what: str, value: object) -> None:
    """A parallel size is an int >= 1 (not a bool, not a float)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}={value!r} must be an int >= 1")


# NOTE [ One ring per pipeline stage ]: under pipeline parallelism every (DP, CP) group has one
# ring per stage (``backbone/dp<d>/cp<c>/pp<s>``, consumed by that stage's TP ranks), each fed by
# its own reorganizer from the mini-batch's one plan (``MiniBatchPlan.stage_consumers``). For two
# reasons: a stage reads only its own layers of the layer-indexed fields (MoE routing
# ``[tokens, layers, topk]``, 384 bytes a token at 48 layers x top-8 in uint8; a stage of PP=k
# reads its 1/k straight into the slot, its tokens x its layers in one 2-D read:
# ``UnitRead.columns``, ``ranges.copy_read``, never a read-then-drop), and the stages of a group
# usually sit on different nodes, which one ring in one node's /dev/shm cannot reach. Every
# other field goes whole to every stage's ring: megatron's first stage needs the tokens, the last
# one labels, loss_mask and the loss's fields, a middle one only cu_seqlens, but which stage
# reads what is the user's forward step's business, and those fields are a few bytes a token
# (int32 tokens, float32 logprobs) against routing's hundreds, so dropping them would tie a
# ring's contents to the forward step for a small saving. The stage split of the layers is the
# model's (megatron-core's ``get_transformer_layer_offset`` / ``get_num_layers_to_build``, read
# by ``knitkit.integration.megatron.stage_layers``), carried by the plan (``stage_layers``) so
# every rank checks its routers against it. Store consumers, write-back and the driver's ledger
# stay per (DP, CP) group (its writer rank is TP 0 of the last stage); a group's units are freed
# once every stage's reorganizer published the mini-batch. A job of one stage keeps one ring per
# group under the group's name, and plans whose JSON has no stage fields.


@dataclass(frozen=True, slots=True)
class StageLayers:
    """Pipeline stages' shares of layer-indexed per-token fields (``[tokens, layers, ...]``, e.g.
    MoE routing): stage ``s`` reads only layers ``ranges[s]`` of each of ``fields``, its tokens
    x its layers in one 2-D read (NOTE [ One ring per pipeline stage ])."""

    ranges: tuple[SeqRange, ...]
    """Per stage, its decoder layers ``[start, stop)``, back to back from layer 0, as
    megatron-core builds them (``knitkit.integration.megatron.stage_layers(config)``)."""
    fields: tuple[str, ...]
    """Per-token fields whose axis 1 is the decoder layer (e.g. ``("routing",)``)."""

    def __post_init__(self) -> None:
        ranges = tuple(tuple(r) for r in self.ranges)  # JSON gives lists
        object.__setattr__(self, "ranges", ranges)
        object.__setattr__(self, "fields", tuple(self.fields))
        stop = 0
        for stage, bounds in enumerate(ranges):
            ok = len(bounds) == 2 and all(type(b) is int for b in bounds)
            if not ok or bounds[0] != stop or bounds[1] < bounds[0]:
                raise ValueError(
                    f"StageLayers.ranges={list(ranges)}: stage {stage}'s layers {bounds} must be "
                    f"[start, stop) ints starting at layer {stop}, where the previous stage "
                    "stops (stages hold consecutive layers, as megatron-core builds them)"
                )
            stop = bounds[1]
        if not ranges:
            raise ValueError("StageLayers.ranges is empty; give one [start, stop) per stage")
        if not all(isinstance(f, str) and f for f in self.fields):
            raise ValueError(f"StageLayers.fields={self.fields!r} must be field names")

    @property
    def stages(self) -> int:
        return len(self.ranges)

    @property
    def num_layers(self) -> int:
        """Layers of the whole model (axis 1 of each field as stored)."""
        return self.ranges[-1][1]


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """One trajectory's share of a packed micro-batch on one CP rank."""

    trajectory_id: str
    num_tokens: int
    """Real (unpadded) tokens of the whole trajectory."""
    padded_length: int
    """Whole-sequence length after padding to ``Topology.pad_multiple``."""
    chunks: tuple[SeqRange, ...]
    """This CP rank's ranges in padded coordinates, in packing order (two chunks when cp > 1).
    They are also the position ids; positions >= ``num_tokens`` are padding."""
    multimodal: tuple[MultimodalRef, ...] = ()
    """The trajectory's multimodal inputs (all of them; intersect with ``chunks`` for this rank)."""

    @property
    def local_length(self) -> int:
        """Packed length of this slice on this CP rank (padding included)."""
        return sum(stop - start for start, stop in self.chunks)

    @property
    def read_ranges(self) -> tuple[SeqRange, ...]:
        """``chunks`` clipped to the real tokens: the ranges read from every per-token unit."""
        clipped = ((start, min(stop, self.num_tokens)) for start, stop in self.chunks)
        return tuple((start, stop) for start, stop in clipped if stop > start)


def build_many(cls: type[_T], count: int, *columns: Iterable[Any]) -> list[_T]:
    """``count`` instances of the slotted dataclass ``cls``, field i of instance j from
    ``columns[i]``'s j-th value, without running ``__init__`` (so no ``__post_init__`` checks).

    Equal to calling the class, two to three times as fast: it sets the slots directly instead of
    through a frozen dataclass's per-field ``object.__setattr__``, one field at a time over all
    instances so every loop runs in C. The planner builds one ``SequenceSlice`` per (trajectory,
    CP rank), 32k of them at DP128 x CP2 with 16k trajectories.
    """
    out = list(map(object.__new__, itertools.repeat(cls, count)))
    for setter, column in zip(slot_setters(cls), columns, strict=True):
        collections.deque(map(setter, out, column), maxlen=0)
    return out


def field_views(
    names: Iterable[str],
    dtypes: Iterable[str],
    shapes: Iterable[tuple[int, ...]],
    offsets: Iterable[int],
) -> list[FieldView]:
    """``FieldView``s from columns, like ``build_many`` but a view at a time with its four slot
    setters unrolled: a layout is built (reorganizer) and decoded (each TP rank) per micro-batch,
    ~10 views each, where this costs 0.3 us a view against ``build_many``'s 0.5 and ``__init__``'s
    2 (thread time, 2-core dev box, issue 31)."""
    set_name, set_dtype, set_shape, set_offset = slot_setters(FieldView)
    new = object.__new__
    out = []
    for name, dtype, shape, offset in zip(names, dtypes, shapes, offsets, strict=True):
        view = new(FieldView)
        set_name(view, name)
        set_dtype(view, dtype)
        set_shape(view, shape)
        set_offset(view, offset)
        out.append(view)
    return out


@dataclass(frozen=True, slots=True)
class MicroBatchPlan:
    """One micro-batch of one (DP, CP) consumer: its sequences in packing order and fields to read."""

    index: int
    """Position in the consumer's consumption order (same count on every DP rank)."""
    sequences: tuple[SequenceSlice, ...]
    token_fields: tuple[str, ...]
    """Per-token fields read with the sequences' ranges (e.g. "tokens", "logprobs", "routing")."""
    scalar_fields: tuple[str, ...] = ()
    """Per-trajectory fields read whole (e.g. "reward")."""
    columns: tuple[tuple[str, int, int], ...] = field(default=(), repr=False)
    """``(field, start, stop)``: per-token fields read only along ``[start, stop)`` of axis 1 (a
    pipeline stage's layers, ``ConsumerPlan.for_stage``); the others are read whole per row."""

    @property
    def num_tokens(self) -> int:
        """Packed tokens (padding included) on this consumer."""
        return sum(s.local_length for s in self.sequences)

    def column_range(self, name: str) -> SeqRange | None:
        """The axis-1 range field ``name`` is read along, ``None`` for every column."""
        for f, start, stop in self.columns:
            if f == name:
                return (start, stop)
        return None

    def reads(self) -> tuple[UnitRead, ...]:
        """Every unit read of this micro-batch, sequence by sequence, fields in declared order."""
        out: list[UnitRead] = []
        columns = [(f, self.column_range(f)) for f in self.token_fields]
        for seq in self.sequences:
            ranges = seq.read_ranges
            out.extend(UnitRead(UnitKey(seq.trajectory_id, f), ranges, c) for f, c in columns)
            out.extend(UnitRead(UnitKey(seq.trajectory_id, f)) for f in self.scalar_fields)
        return tuple(out)

    def unpack(self, values: np.ndarray) -> tuple[SequenceRows, ...]:
        """The exact inverse of packing one per-token field of this micro-batch on its consumer.

        ``values`` holds one row per packed token of this CP rank (``num_tokens`` rows, padding
        included, in packing order: NOTE [ Packing order ]), e.g. a forward-only pass's per-token
        log-probs. Returns, per sequence with real tokens here, its trajectory, the token ranges
        this rank holds (CP chunks clipped to the real tokens, touching chunks joined) and their
        rows back to back (views of ``values``); padding rows are dropped. Pure: what
        ``TrajectoryStore.write_ranges`` takes, so every real token lands where it came from.
        """
        values = np.asarray(values)
        if values.ndim == 0 or values.shape[0] != self.num_tokens:
            raise ValueError(
                f"micro-batch {self.index}: {values.shape[0] if values.ndim else 'no'} rows to "
                f"unpack but it packs {self.num_tokens} tokens on this consumer (padding "
                "included); pass one row per packed token, in packing order"
            )
        out: list[SequenceRows] = []
        offset = 0
        for seq in self.sequences:
            ranges: list[SeqRange] = []
            rows: list[np.ndarray] = []
            for start, stop in seq.chunks:
                real = min(stop, seq.num_tokens)
                if real > start:
                    if ranges and ranges[-1][1] == start:
                        ranges[-1] = (ranges[-1][0], real)
                    else:
                        ranges.append((start, real))
                    rows.append(values[offset : offset + real - start])
                offset += stop - start
            if ranges:
                joined = rows[0] if len(rows) == 1 else np.concatenate(rows)
                out.append(SequenceRows(seq.trajectory_id, tuple(ranges), joined))
        return tuple(out)

    def with_fields(
        self, token_fields: tuple[str, ...], scalar_fields: tuple[str, ...]
    ) -> MicroBatchPlan:
        """This micro-batch carrying only the given fields (same sequences, same packing)."""
        columns = tuple(c for c in self.columns if c[0] in token_fields)
        return MicroBatchPlan(self.index, self.sequences, token_fields, scalar_fields, columns)


# NOTE [ Packing order ]: a consumer's packed micro-batch lays its sequences back to back in
# plan order, each as its CP chunks in ``SequenceSlice.chunks`` order (one chunk at CP=1, chunks
# r and 2cp-1-r at CP rank r), every chunk ``stop - start`` rows long, padding rows (positions
# >= ``num_tokens``) included at their place: ``packing.pack_layout`` sizes fields that way,
# ``packing.PackTemplate.fill`` fills them, and ``MicroBatchPlan.unpack`` reads
# them back. Change all three together.


@dataclass(frozen=True, slots=True)
class SequenceRows:
    """One trajectory's rows of an unpacked per-token field: where they go, and the rows."""

    trajectory_id: str
    ranges: tuple[SeqRange, ...]
    """Token ranges in the trajectory (disjoint, increasing), real tokens only."""
    rows: np.ndarray
    """The ranges' rows back to back (``sum(stop - start)`` rows)."""


@dataclass(frozen=True, slots=True)
class FieldSchema:
    """dtype and row shape (per-token field) or value shape (scalar) of one field, for packing."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ConsumerPlan:
    """Everything one backbone (DP, CP) consumer group (shared by its TP ranks) reads, in order."""

    dp_rank: int
    cp_rank: int
    micro_batches: tuple[MicroBatchPlan, ...]
    schema: tuple[FieldSchema, ...] = ()
    """Every field's dtype and row shape (``TrajectoryStore.register`` fills it in), so a consumer
    with no trajectories (an idle DP rank) still gets a valid empty layout."""
    stage: int | None = field(default=None, repr=False)
    """The pipeline stage whose ring this assignment feeds (``for_stage``); ``None``: the
    group's one ring (a job of one stage)."""

    @property
    def name(self) -> str:
        group = f"backbone/dp{self.dp_rank}/cp{self.cp_rank}"
        return group if self.stage is None else f"{group}/pp{self.stage}"

    def for_stage(self, stage: int, layers: StageLayers | None) -> ConsumerPlan:
        """This group's assignment for pipeline stage ``stage``'s ring: the same micro-batches,
        each of ``layers.fields`` they pack read along the stage's layers only (``columns``);
        ``layers=None``: every field whole (NOTE [ One ring per pipeline stage ])."""
        if layers is None:
            return replace(self, stage=stage)
        start, stop = layers.ranges[stage]
        micro_batches = tuple(
            replace(
                mb, columns=tuple((f, start, stop) for f in layers.fields if f in mb.token_fields)
            )
            for mb in self.micro_batches
        )
        return replace(self, micro_batches=micro_batches, stage=stage)

    def part(self, start: int, stop: int) -> ConsumerPlan:
        """This assignment's micro-batches ``start:stop`` only (served as their reads are
        produced: NOTE [ Serving as write-backs arrive ] in knitkit/job/serving.py)."""
        if (start, stop) == (0, len(self.micro_batches)):
            return self
        return replace(self, micro_batches=self.micro_batches[start:stop])

    @property
    def row_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``schema`` as ``{name: (dtype, row shape)}`` (``packing.RowSpec`` values)."""
        return {f.name: (f.dtype, f.shape) for f in self.schema}

    def reads(self) -> tuple[UnitRead, ...]:
        return tuple(r for mb in self.micro_batches for r in mb.reads())

    def __reduce__(self) -> tuple[Callable[..., ConsumerPlan], tuple[Any, ...]]:
        """Pickled as columns of plain values (NOTE [ Plans pickled as columns ])."""
        micro_batches = self.micro_batches
        seqs = [s for mb in micro_batches for s in mb.sequences]
        return _consumer_plan, (
            self.dp_rank,
            self.cp_rank,
            self.stage,
            tuple((f.name, f.dtype, f.shape) for f in self.schema),
            tuple(
                (mb.index, len(mb.sequences), mb.token_fields, mb.scalar_fields, mb.columns)
                for mb in micro_batches
            ),
            tuple(s.trajectory_id for s in seqs),
            tuple(s.num_tokens for s in seqs),
            tuple(s.padded_length for s in seqs),
            tuple(s.chunks for s in seqs),
            tuple(_refs_columns(s.multimodal) for s in seqs),
        )


# NOTE [ Plans pickled as columns ]: the driver pickles every assignment it submits to a
# reorganizer process (on the eager path: after the step's barrier) and the reorganizer
# unpickles it before its first copy, its caches cold after the idle wait. A frozen slotted
# dataclass pickles through ``dataclasses``' ``__getstate__`` / ``__setstate__``: a Python frame
# and a ``fields()`` call per object, ~45 objects per transfer.py ``ConsumerPlan`` (57 us to dump,
# 53 us to load, hot; ~240 us from a reorganizer's wake to its plan loaded). ``ConsumerPlan`` and
# ``EncoderRankPlan`` pickle as columns of plain values instead, rebuilt with ``build_many``
# (values that came from checked objects: no ``__post_init__`` runs again): 12 us to dump, 36 us
# to load, 930 bytes instead of 1,236 (transfer.py's plans, thread time, 2-core dev box, issue 31).
def _refs_columns(refs: tuple[MultimodalRef, ...]) -> tuple[tuple[Any, ...], ...]:
    """``refs`` as ``(key owner, key field, token_start, num_tokens, cost)`` tuples."""
    return tuple((r.key.owner, r.key.field, r.token_start, r.num_tokens, r.cost) for r in refs)


def _columns(rows: Iterable[tuple[Any, ...]], width: int) -> list[tuple[Any, ...]]:
    """``rows`` transposed: ``width`` columns (empty ones when there are no rows)."""
    return list(zip(*rows, strict=True)) or [()] * width


def _consumer_plan(
    dp_rank: int,
    cp_rank: int,
    stage: int | None,
    schema: tuple[tuple[str, str, tuple[int, ...]], ...],
    micro_batches: tuple[tuple[Any, ...], ...],
    trajectory_ids: tuple[str, ...],
    num_tokens: tuple[int, ...],
    padded_lengths: tuple[int, ...],
    chunks: tuple[tuple[SeqRange, ...], ...],
    multimodal: tuple[tuple[tuple[Any, ...], ...], ...],
) -> ConsumerPlan:
    """A ``ConsumerPlan`` from ``ConsumerPlan.__reduce__``'s columns."""
    flat = [ref for refs in multimodal for ref in refs]
    owners, names, token_starts, tokens, costs = _columns(flat, 5)
    keys = build_many(UnitKey, len(flat), owners, names)
    built = iter(build_many(MultimodalRef, len(flat), keys, token_starts, tokens, costs))
    refs = [tuple(itertools.islice(built, len(r))) for r in multimodal]
    seqs = build_many(
        SequenceSlice, len(trajectory_ids), trajectory_ids, num_tokens, padded_lengths, chunks, refs
    )
    indexes, counts, token_fields, scalar_fields, columns = _columns(micro_batches, 5)
    bounds = itertools.pairwise(itertools.accumulate(counts, initial=0))
    sequences = [tuple(seqs[start:stop]) for start, stop in bounds]
    plans = build_many(
        MicroBatchPlan, len(indexes), indexes, sequences, token_fields, scalar_fields, columns
    )
    fields_ = build_many(FieldSchema, len(schema), *_columns(schema, 3))
    return ConsumerPlan(dp_rank, cp_rank, tuple(plans), tuple(fields_), stage)


@dataclass(frozen=True, slots=True)
class EncoderRankPlan:
    """The unique multimodal units one encoder DP rank encodes, split into its own micro-batches."""

    encoder: str
    dp_rank: int
    micro_batches: tuple[tuple[UnitKey, ...], ...]

    @property
    def name(self) -> str:
        return f"{self.encoder}/dp{self.dp_rank}"

    @property
    def units(self) -> tuple[UnitKey, ...]:
        return tuple(k for mb in self.micro_batches for k in mb)

    def reads(self) -> tuple[UnitRead, ...]:
        return tuple(UnitRead(k) for k in self.units)

    def __reduce__(self) -> tuple[Callable[..., EncoderRankPlan], tuple[Any, ...]]:
        """Pickled as columns of plain values (NOTE [ Plans pickled as columns ])."""
        units = self.units
        return _encoder_rank_plan, (
            self.encoder,
            self.dp_rank,
            tuple(len(mb) for mb in self.micro_batches),
            tuple(k.owner for k in units),
            tuple(k.field for k in units),
        )


def _encoder_rank_plan(
    encoder: str,
    dp_rank: int,
    counts: tuple[int, ...],
    owners: tuple[str, ...],
    names: tuple[str, ...],
) -> EncoderRankPlan:
    """An ``EncoderRankPlan`` from ``EncoderRankPlan.__reduce__``'s columns."""
    keys = iter(build_many(UnitKey, len(owners), owners, names))
    micro_batches = tuple(tuple(itertools.islice(keys, count)) for count in counts)
    return EncoderRankPlan(encoder, dp_rank, micro_batches)


@dataclass(frozen=True, slots=True)
class EncoderPlan:
    """One encoder's assignment: per encoder DP rank, the mini-batch's unique inputs it encodes."""

    topology: EncoderTopology
    ranks: tuple[EncoderRankPlan, ...]


@dataclass(frozen=True, slots=True)
class MiniBatchPlan:
    """The whole assignment of one admitted mini-batch: backbone consumers plus every encoder."""

    minibatch_id: str
    topology: Topology
    consumers: tuple[ConsumerPlan, ...]
    """Ordered DP-major: ``consumers[dp * topology.cp + cp]``."""
    encoders: tuple[EncoderPlan, ...] = ()
    stage_layers: StageLayers | None = field(default=None, repr=False)
    """Pipeline stages' layers of layer-indexed fields (``PlannerConfig.stage_layers``)."""

    def consumer(self, dp_rank: int, cp_rank: int) -> ConsumerPlan:
        if not (0 <= dp_rank < self.topology.dp and 0 <= cp_rank < self.topology.cp):
            raise IndexError(f"no consumer (dp={dp_rank}, cp={cp_rank}) in {self.topology}")
        return self.consumers[dp_rank * self.topology.cp + cp_rank]

    def encoder(self, name: str) -> EncoderPlan:
        for plan in self.encoders:
            if plan.topology.name == name:
                return plan
        raise KeyError(f"mini-batch plan has no encoder {name!r}")

    @property
    def num_micro_batches(self) -> int:
        return len(self.consumers[0].micro_batches) if self.consumers else 0

    def stage_consumers(self, pipeline: int) -> tuple[ConsumerPlan, ...]:
        """What the backbone reorganizers serve: ``consumers`` in a job of one stage, else one
        assignment per (DP, CP, stage), each for its stage's ring (``ConsumerPlan.for_stage``),
        DP-major, then CP, then stage. ``ValueError`` when ``stage_layers`` splits the layers
        over another number of stages (NOTE [ One ring per pipeline stage ])."""
        layers = self.stage_layers
        if layers is not None and layers.stages != pipeline:
            raise ValueError(
                f"plan {self.minibatch_id!r} splits layers over {layers.stages} pipeline stages "
                f"({list(layers.ranges)}) but the job runs {pipeline}; build "
                "PlannerConfig(stage_layers=...) for the job's pipeline"
            )
        if pipeline == 1:
            return self.consumers
        return tuple(c.for_stage(s, layers) for c in self.consumers for s in range(pipeline))

    def reads_by_consumer(self) -> dict[str, tuple[UnitRead, ...]]:
        """Reads of every consumer (backbone and encoder ranks) by consumer name."""
        out = {c.name: c.reads() for c in self.consumers}
        out.update({r.name: r.reads() for e in self.encoders for r in e.ranks})
        return out

    def with_fields(self, fields: Iterable[str]) -> MiniBatchPlan:
        """This plan with every backbone micro-batch carrying only ``fields`` (a pass's reads).

        The same trajectories, chunks and micro-batches (one plan serves every pass): per-token
        and scalar fields keep their planned order, the schema keeps its entries for them, the
        encoders' plans are unchanged. ``ValueError`` names fields the plan does not carry.
        """
        wanted = set(fields)
        planned = {f for c in self.consumers for mb in c.micro_batches for f in mb.token_fields}
        planned |= {f for c in self.consumers for mb in c.micro_batches for f in mb.scalar_fields}
        unknown = sorted(wanted - planned)
        if unknown and self.num_micro_batches:
            raise ValueError(
                f"plan {self.minibatch_id!r} carries no fields {unknown} (it carries "
                f"{sorted(planned)}); plan the mini-batch with every field its passes read"
            )
        consumers = []
        for consumer in self.consumers:
            micro_batches = tuple(
                mb.with_fields(
                    tuple(f for f in mb.token_fields if f in wanted),
                    tuple(f for f in mb.scalar_fields if f in wanted),
                )
                for mb in consumer.micro_batches
            )
            schema = tuple(f for f in consumer.schema if f.name in wanted)
            consumers.append(replace(consumer, micro_batches=micro_batches, schema=schema))
        return replace(self, consumers=tuple(consumers))

    def with_schema(self, schema: Mapping[str, tuple[str, tuple[int, ...]]]) -> MiniBatchPlan:
        """This plan with ``schema`` (``{field: (dtype, row shape)}``) given to every consumer."""
        fields = tuple(FieldSchema(n, d, tuple(s)) for n, (d, s) in sorted(schema.items()))
        consumers = tuple(replace(c, schema=fields) for c in self.consumers)
        return replace(self, consumers=consumers)

    def check(self) -> None:
        """Each trajectory belongs to one DP rank and appears once in its consumers' micro-batches.

        Raises ``ValueError`` naming the trajectory: planned twice, its tokens would be
        delivered (and trained on) twice.
        """
        owner: dict[str, int] = {}
        for consumer in self.consumers:
            seen: set[str] = set()
            for micro_batch in consumer.micro_batches:
                for seq in micro_batch.sequences:
                    tid = seq.trajectory_id
                    if tid in seen:
                        raise ValueError(
                            f"plan {self.minibatch_id!r}: trajectory {tid!r} appears twice "
                            f"in consumer {consumer.name}; plan each trajectory once"
                        )
                    seen.add(tid)
                    if owner.setdefault(tid, consumer.dp_rank) != consumer.dp_rank:
                        raise ValueError(
                            f"plan {self.minibatch_id!r}: trajectory {tid!r} is planned on DP "
                            f"ranks {owner[tid]} and {consumer.dp_rank}; plan each trajectory once"
                        )

    def to_json(self) -> str:
        return json.dumps(_encode(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> MiniBatchPlan:
        return _decode_plan(json.loads(text))


_LEFT_OUT = {"columns": (), "stage": None, "stage_layers": None}
"""Fields written to JSON only when set (and never to repr): a plan of one stage reads as before."""


def _encode(value: Any) -> Any:
    if isinstance(value, UnitKey):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        return {
            name: _encode(getattr(value, name))
            for name in value.__dataclass_fields__
            if name not in _LEFT_OUT or getattr(value, name) != _LEFT_OUT[name]
        }
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    return value


def _ranges(raw: list[list[int]]) -> tuple[SeqRange, ...]:
    return tuple((int(a), int(b)) for a, b in raw)


def _decode_plan(raw: dict[str, Any]) -> MiniBatchPlan:
    def sequence(s: dict[str, Any]) -> SequenceSlice:
        refs = tuple(
            MultimodalRef(UnitKey.parse(m["key"]), m["token_start"], m["num_tokens"], m["cost"])
            for m in s["multimodal"]
        )
        return SequenceSlice(
            s["trajectory_id"], s["num_tokens"], s["padded_length"], _ranges(s["chunks"]), refs
        )

    def field(f: dict[str, Any]) -> FieldSchema:
        return FieldSchema(f["name"], f["dtype"], tuple(f["shape"]))

    def micro(m: dict[str, Any]) -> MicroBatchPlan:
        seqs = tuple(sequence(s) for s in m["sequences"])
        columns = tuple((str(f), int(a), int(b)) for f, a, b in m.get("columns", ()))
        token, scalar = tuple(m["token_fields"]), tuple(m["scalar_fields"])
        return MicroBatchPlan(m["index"], seqs, token, scalar, columns)

    def encoder(e: dict[str, Any]) -> EncoderPlan:
        t = e["topology"]
        topo = EncoderTopology(t["name"], t["dp"], t["tp"], tuple(t["kinds"]))
        ranks = tuple(
            EncoderRankPlan(
                r["encoder"],
                r["dp_rank"],
                tuple(tuple(UnitKey.parse(k) for k in mb) for mb in r["micro_batches"]),
            )
            for r in e["ranks"]
        )
        return EncoderPlan(topo, ranks)

    consumers = tuple(
        ConsumerPlan(
            c["dp_rank"],
            c["cp_rank"],
            tuple(micro(m) for m in c["micro_batches"]),
            tuple(field(f) for f in c.get("schema", ())),
            c.get("stage"),
        )
        for c in raw["consumers"]
    )
    layers = raw.get("stage_layers")
    return MiniBatchPlan(
        raw["minibatch_id"],
        Topology(**raw["topology"]),
        consumers,
        tuple(encoder(e) for e in raw["encoders"]),
        None if layers is None else StageLayers(_ranges(layers["ranges"]), tuple(layers["fields"])),
    )
