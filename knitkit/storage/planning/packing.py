"""THD packing of one consumer's micro-batch: layout from the plan, then fill a flat buffer via reads."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate

import numpy as np

from knitkit.storage.planning.plan import MicroBatchPlan
from knitkit.types import MicroBatchLayout, SeqRange, UnitKey, UnitRead

RowSpec = tuple[str, tuple[int, ...]]
"""A field's numpy dtype name and the shape of one row (per-token) or of the value (scalar)."""

ReadInto = Callable[[UnitRead, np.ndarray], object]
"""Fills the given C-contiguous array with one unit read, e.g.
``lambda r, out: backend.read(r.key, r.ranges, out=out)``."""

ReadMany = Callable[[Sequence[UnitRead], Sequence[np.ndarray]], object]
"""Fills ``outs[i]`` with ``reads[i]`` for every i in one call, e.g. ``backend.read_many``."""

POSITION_IDS = "position_ids"
LOSS_MASK = "loss_mask"
CU_SEQLENS = "cu_seqlens"
CU_SEQLENS_PADDED = "cu_seqlens_padded"


def pack_layout(
    micro_batch: MicroBatchPlan,
    schema: Mapping[str, RowSpec],
    extra: Mapping[str, int | float | str] | None = None,
) -> MicroBatchLayout:
    """The THD layout of ``micro_batch`` on its consumer, computed from the plan alone.

    Fields: every per-token field ``[T, *row]`` (T = packed tokens of this CP rank, padding
    included), ``position_ids`` int64 ``[T]``, ``loss_mask`` (generated as float32 1/0 for real
    tokens/padding unless stored as a per-token field, then sliced like the others), every scalar
    field ``[n, *shape]``, and ``cu_seqlens`` / ``cu_seqlens_padded`` int32 ``[n + 1]`` over the
    WHOLE sequences (what Megatron's ``PackedSeqParams`` expects under CP; this rank's packed
    offsets are ``cu_seqlens_padded // cp``), the latter also as ``layout.cu_seqlens_padded``.
    """
    missing = [
        f for f in (*micro_batch.token_fields, *micro_batch.scalar_fields) if f not in schema
    ]
    if missing:
        raise KeyError(f"no dtype/shape for fields {missing}; schema has {sorted(schema)}")
    total = micro_batch.num_tokens
    count = len(micro_batch.sequences)
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in micro_batch.token_fields:
        dtype, row = schema[name]
        columns = micro_batch.column_range(name)
        if columns is not None:  # a stage's layers (NOTE [ One ring per pipeline stage ])
            if not row or not 0 <= columns[0] <= columns[1] <= row[0]:
                raise ValueError(
                    f"field {name!r} has rows {list(row)}; the plan reads its axis-1 columns "
                    f"{list(columns)}: plan with StageLayers of this field's layer count"
                )
            row = (columns[1] - columns[0], *row[1:])
        specs[name] = (dtype, (total, *row))
    specs[POSITION_IDS] = ("int64", (total,))
    specs.setdefault(LOSS_MASK, ("float32", (total,)))
    for name in micro_batch.scalar_fields:
        dtype, shape = schema[name]
        specs[name] = (dtype, (count, *shape))
    specs[CU_SEQLENS] = ("int32", (count + 1,))
    specs[CU_SEQLENS_PADDED] = ("int32", (count + 1,))
    padded = accumulate((s.padded_length for s in micro_batch.sequences), initial=0)
    info: dict[str, int | float | str] = {"micro_batch": micro_batch.index, "num_tokens": total}
    info.update(extra or {})
    return MicroBatchLayout.build(
        specs,
        cu_seqlens_padded=tuple(padded),
        trajectory_ids=tuple(s.trajectory_id for s in micro_batch.sequences),
        extra=info,
    )


def unit_reads(
    micro_batch: MicroBatchPlan, views: Mapping[str, np.ndarray]
) -> tuple[list[UnitRead], list[np.ndarray]]:
    """Every unit read of ``micro_batch`` with the slice of ``views`` it lands in, in packing order
    (NOTE [ Packing order ] in plan.py; ``MicroBatchPlan.unpack`` is its inverse).

    Adjacent ranges are merged (CP rank ``cp - 1`` reads its two chunks as one run), so a backend
    moves each contiguous run with one copy.
    """
    reads: list[UnitRead] = []
    outs: list[np.ndarray] = []
    token_views = [
        (name, views[name], micro_batch.column_range(name)) for name in micro_batch.token_fields
    ]
    scalar_views = [(name, views[name]) for name in micro_batch.scalar_fields]
    offset = 0
    for i, seq in enumerate(micro_batch.sequences):
        ranges = _merge_adjacent(seq.read_ranges)
        real = sum(b - a for a, b in ranges)
        for name, view, columns in token_views:
            reads.append(UnitRead(UnitKey(seq.trajectory_id, name), ranges, columns))
            outs.append(view[offset : offset + real])
        for name, view in scalar_views:
            reads.append(UnitRead(UnitKey(seq.trajectory_id, name)))
            outs.append(view[i : i + 1].reshape(view.shape[1:]))
        offset += seq.local_length
    return reads, outs


def fill_generated(
    micro_batch: MicroBatchPlan, layout: MicroBatchLayout, views: Mapping[str, np.ndarray]
) -> None:
    """Everything but the unit reads, in one pass over the sequences with no temporary arrays:
    padding rows of per-token fields zeroed (one slice per padded sequence and field),
    ``position_ids`` (one ``np.add`` of a cached ramp per CP chunk), the generated ``loss_mask``
    and both ``cu_seqlens``. The calls are per sequence, like the unit reads, never per token."""
    padded_views = [views[name] for name in micro_batch.token_fields]
    if LOSS_MASK not in micro_batch.token_fields:
        mask = views[LOSS_MASK]
        mask.fill(1.0)
        padded_views.append(mask)
    positions = views[POSITION_IDS]
    ramp = _ramp(positions.shape[0])
    offset = 0
    cu = [0]
    for seq in micro_batch.sequences:
        real = 0
        for start, stop in seq.chunks:
            np.add(ramp[: stop - start], start, out=positions[offset : offset + stop - start])
            real += max(0, min(stop, seq.num_tokens) - start)
            offset += stop - start
        first = offset - seq.local_length + real
        if first < offset:
            for view in padded_views:
                view[first:offset] = 0
        cu.append(cu[-1] + seq.num_tokens)
    views[CU_SEQLENS][:] = cu
    views[CU_SEQLENS_PADDED][:] = layout.cu_seqlens_padded


def _ramp(length: int) -> np.ndarray:
    """``arange(length)`` as int64 from a module-level cache that only grows (read-only)."""
    global _RAMP
    if _RAMP.shape[0] < length:
        _RAMP = np.arange(max(length, 2 * _RAMP.shape[0]), dtype=np.int64)
        _RAMP.flags.writeable = False
    return _RAMP


_RAMP = np.arange(0, dtype=np.int64)


def pack_into(
    micro_batch: MicroBatchPlan,
    layout: MicroBatchLayout,
    buffer: memoryview | bytearray | np.ndarray,
    read: ReadInto,
) -> dict[str, np.ndarray]:
    """Fill ``buffer`` (e.g. a shared-memory slot) with the packed micro-batch; returns the views.

    Every unit read lands straight in its place in ``buffer``; padding rows and the alignment
    bytes between fields are zeroed, so a reused buffer carries nothing over from the previous
    micro-batch.
    """
    return pack_into_batched(
        micro_batch,
        layout,
        buffer,
        lambda reads, outs: [read(r, out) for r, out in zip(reads, outs, strict=True)],
    )


def pack_into_batched(
    micro_batch: MicroBatchPlan,
    layout: MicroBatchLayout,
    buffer: memoryview | bytearray | np.ndarray,
    read_many: ReadMany,
) -> dict[str, np.ndarray]:
    """``pack_into`` with every unit read of the micro-batch in ONE ``read_many`` call (e.g.
    ``backend.read_many``: one batched round trip or ``preadv`` where the backend can)."""
    views = layout.numpy_views(buffer)
    reads, outs = unit_reads(micro_batch, views)
    read_many(reads, outs)
    fill_generated(micro_batch, layout, views)
    layout.clear_padding(buffer)
    return views


def _merge_adjacent(ranges: tuple[SeqRange, ...]) -> tuple[SeqRange, ...]:
    """``ranges`` with each range that starts where the previous one stops joined to it."""
    if len(ranges) < 2:
        return ranges
    merged = [ranges[0]]
    for start, stop in ranges[1:]:
        if start == merged[-1][1]:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return tuple(merged)


def pack(
    micro_batch: MicroBatchPlan, schema: Mapping[str, RowSpec], read: ReadInto
) -> tuple[MicroBatchLayout, np.ndarray]:
    """Layout plus a freshly allocated, filled buffer (tests and the sample-level path)."""
    layout = pack_layout(micro_batch, schema)
    buffer = np.empty(layout.nbytes, dtype=np.uint8)
    pack_into(micro_batch, layout, buffer, read)
    return layout, buffer
