"""Sample-level baseline: ranks read their DP share's whole trajectories; TP0/CP0 shares the images."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.backends.ranges import check_ranges, destination, spec_of
from knitkit.storage.baselines.arena import Arena
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.planning.packing import RowSpec, pack, pack_into, pack_layout
from knitkit.storage.planning.plan import ConsumerPlan, MicroBatchPlan, MiniBatchPlan
from knitkit.types import MicroBatchLayout, UnitKey, UnitRead

MULTIMODAL_KINDS = ("image", "video")


@dataclass(frozen=True, slots=True)
class RankPosition:
    """Where a training rank sits in the backbone topology."""

    dp: int
    cp: int
    tp: int

    @property
    def reads_multimodal(self) -> bool:
        """Sample-level systems read multimodal inputs on TP0/CP0 and redistribute them."""
        return self.tp == 0 and self.cp == 0


class LocalTrajectories:
    """Whole units held in this rank's memory; range reads slice them, no storage I/O."""

    def __init__(self, units: Mapping[UnitKey, np.ndarray], arena: Arena | None = None) -> None:
        self.units = dict(units)
        self.arena = arena
        """Where received copies go (``receive_multimodal``); fresh arrays when ``None``."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.units.values())

    def read_into(self, read: UnitRead, out: np.ndarray) -> None:
        """``packing.ReadInto`` over the local copies."""
        unit = self.units[read.key]
        ranges = check_ranges(read.key, spec_of(unit), read.ranges)
        dst = destination(read.key, spec_of(unit), ranges, out)
        if ranges is None:
            np.copyto(dst, unit)
            return
        row = 0
        for start, stop in ranges:
            dst[row : row + stop - start] = unit[start:stop]
            row += stop - start

    def schema(self, micro_batch: MicroBatchPlan) -> dict[str, RowSpec]:
        """dtype and row shape of every field the micro-batch packs."""
        if not micro_batch.sequences:
            return {}
        first = micro_batch.sequences[0].trajectory_id
        out: dict[str, RowSpec] = {}
        for name in micro_batch.token_fields:
            unit = self.units[UnitKey(first, name)]
            out[name] = (unit.dtype.name, unit.shape[1:])
        for name in micro_batch.scalar_fields:
            unit = self.units[UnitKey(first, name)]
            out[name] = (unit.dtype.name, unit.shape)
        return out


def share_reads(plan: MiniBatchPlan, rank: RankPosition) -> list[UnitKey]:
    """Every unit a sample-level rank reads whole: its DP share's fields on every rank, plus
    each trajectory's multimodal inputs on TP0/CP0 (once per referencing trajectory, as a
    per-trajectory sample store holds them)."""
    group = plan.consumer(rank.dp, rank.cp)
    keys: list[UnitKey] = []
    for micro_batch in group.micro_batches:
        fields = (*micro_batch.token_fields, *micro_batch.scalar_fields)
        for seq in micro_batch.sequences:
            keys.extend(UnitKey(seq.trajectory_id, name) for name in fields)
            if rank.reads_multimodal:
                keys.extend(ref.key for ref in seq.multimodal)
    return keys


def read_share(
    backend: UnitBackend, plan: MiniBatchPlan, rank: RankPosition, arena: Arena | None = None
) -> LocalTrajectories:
    """Materialize the rank's whole DP share eagerly, as sample-level loaders do, into ``arena``
    (reused every step, as a careful user does) or into fresh arrays.

    A key listed twice (an input shared by several trajectories) is read twice.
    """
    if arena is None:
        return LocalTrajectories({key: backend.read(key) for key in share_reads(plan, rank)})
    units = {}
    for key in share_reads(plan, rank):
        spec = backend.spec(key)
        units[key] = backend.read(key, None, out=arena.array(spec.dtype, spec.shape))
    return LocalTrajectories(units, arena)


def pack_local(
    group: ConsumerPlan, local: LocalTrajectories, buffers: Sequence[Arena] = ()
) -> Iterator[tuple[MicroBatchLayout, np.ndarray]]:
    """The rank's micro-batches, packed from its local copies exactly like the reorganizer does,
    into ``buffers`` in turn (each reset before reuse) or into fresh arrays when none are given."""
    for i, micro_batch in enumerate(group.micro_batches):
        if not buffers:
            yield pack(micro_batch, local.schema(micro_batch), local.read_into)
            continue
        arena = buffers[i % len(buffers)]
        arena.reset()
        layout = pack_layout(micro_batch, local.schema(micro_batch))
        buffer = arena.take(layout.nbytes)
        pack_into(micro_batch, layout, buffer, local.read_into)
        yield layout, buffer


def _multimodal_layout(local: LocalTrajectories) -> MicroBatchLayout:
    """One field per multimodal unit the rank holds, for redistribution."""
    units = {k: a for k, a in local.units.items() if k.field in MULTIMODAL_KINDS}
    return MicroBatchLayout.of_units({k: (a.dtype.name, a.shape) for k, a in units.items()})


def send_multimodal(publisher: Publisher, local: LocalTrajectories) -> int:
    """TP0/CP0: publish the multimodal units it read to its DP group's peers; returns bytes."""
    layout = _multimodal_layout(local)
    views = layout.unit_views(publisher.acquire(layout.nbytes))
    for key, view in views.items():
        np.copyto(view, local.units[key])
    publisher.publish(layout)
    return sum(v.nbytes for v in views.values())


def receive_multimodal(consumer: MicroBatchConsumer, local: LocalTrajectories) -> int:
    """A TP/CP peer: copy the multimodal units TP0/CP0 published into ``local``; returns bytes."""
    batch = consumer.next_micro_batch()
    for key, view in batch.layout.unit_views(batch.buffer).items():
        if local.arena is None:
            local.units[key] = view.copy()
        else:
            local.units[key] = local.arena.array(view.dtype, view.shape)
            np.copyto(local.units[key], view)
    batch.release()
    return batch.layout.nbytes
