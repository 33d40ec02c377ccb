"""THD packing of one consumer's micro-batch: layout from the plan, then fill a flat buffer via reads."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from knitkit.storage.planning.plan import MicroBatchPlan
from knitkit.types import MicroBatchLayout, UnitKey, UnitRead

RowSpec = tuple[str, tuple[int, ...]]
"""A field's numpy dtype name and the shape of one row (per-token) or of the value (scalar)."""

ReadInto = Callable[[UnitRead, np.ndarray], object]
"""Fills the given C-contiguous array with one unit read, e.g.
``lambda r, out: backend.read(r.key, r.ranges, out=out)``."""

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
    offsets are ``cu_seqlens_padded // cp``). ``layout.cu_seqlens`` is ``cu_seqlens_padded``.
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
        specs[name] = (dtype, (total, *row))
    specs[POSITION_IDS] = ("int64", (total,))
    specs.setdefault(LOSS_MASK, ("float32", (total,)))
    for name in micro_batch.scalar_fields:
        dtype, shape = schema[name]
        specs[name] = (dtype, (count, *shape))
    specs[CU_SEQLENS] = ("int32", (count + 1,))
    specs[CU_SEQLENS_PADDED] = ("int32", (count + 1,))
    padded = np.cumsum([0, *(s.padded_length for s in micro_batch.sequences)])
    info: dict[str, int | float | str] = {"micro_batch": micro_batch.index, "num_tokens": total}
    info.update(extra or {})
    return MicroBatchLayout.build(
        specs,
        cu_seqlens=tuple(int(x) for x in padded),
        trajectory_ids=tuple(s.trajectory_id for s in micro_batch.sequences),
        extra=info,
    )


def pack_into(
    micro_batch: MicroBatchPlan,
    layout: MicroBatchLayout,
    buffer: memoryview | bytearray | np.ndarray,
    read: ReadInto,
) -> dict[str, np.ndarray]:
    """Fill ``buffer`` (e.g. a shared-memory slot) with the packed micro-batch; returns the views.

    Every unit read lands straight in its place in ``buffer``; padding rows are zeroed, so a
    reused buffer carries nothing over from the previous micro-batch.
    """
    views = layout.numpy_views(buffer)
    generated_mask = LOSS_MASK not in micro_batch.token_fields
    offset = 0
    for i, seq in enumerate(micro_batch.sequences):
        ranges = seq.read_ranges
        real = sum(b - a for a, b in ranges)
        end = offset + seq.local_length
        for name in micro_batch.token_fields:
            read(
                UnitRead(UnitKey(seq.trajectory_id, name), ranges),
                views[name][offset : offset + real],
            )
            views[name][offset + real : end] = 0
        for name in micro_batch.scalar_fields:
            target = views[name][i : i + 1].reshape(views[name].shape[1:])
            read(UnitRead(UnitKey(seq.trajectory_id, name)), target)
        positions = views[POSITION_IDS]
        pos = offset
        for start, stop in seq.chunks:
            positions[pos : pos + stop - start] = np.arange(start, stop)
            pos += stop - start
        if generated_mask:
            views[LOSS_MASK][offset : offset + real] = 1.0
            views[LOSS_MASK][offset + real : end] = 0.0
        offset = end
    lengths = [s.num_tokens for s in micro_batch.sequences]
    views[CU_SEQLENS][:] = np.cumsum([0, *lengths])
    views[CU_SEQLENS_PADDED][:] = layout.cu_seqlens
    return views


def pack(
    micro_batch: MicroBatchPlan, schema: Mapping[str, RowSpec], read: ReadInto
) -> tuple[MicroBatchLayout, np.ndarray]:
    """Layout plus a freshly allocated, filled buffer (tests and the sample-level path)."""
    layout = pack_layout(micro_batch, schema)
    buffer = np.empty(layout.nbytes, dtype=np.uint8)
    pack_into(micro_batch, layout, buffer, read)
    return layout, buffer
