"""TransferQueue sample-level baseline: one TQ row per trajectory, read per rank by KV or by TQ's StreamingDataLoader."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from knitkit.storage import MicroBatchPlan, MiniBatchPlan, Topology, Trajectory
from knitkit.storage.baselines import Arena, LocalTrajectories, RankPosition
from knitkit.storage.planning import (
    SequenceSlice,
    cp_chunks,
    pack_into,
    pack_layout,
    padded_lengths,
)
from knitkit.types import MicroBatchLayout, UnitKey

from .backend import TransferQueueConnection

IMAGE_FIELD = "image"
"""TQ column holding a trajectory's (first) multimodal input, copied per trajectory."""


def put_trajectories(
    client: Any, trajectories: Sequence[Trajectory], partition_id: str, batch: int = 16
) -> None:
    """Write trajectories as TQ users do: one KV row each, every field a column, ragged
    per-token fields as jagged nested tensors, the sample's image stored in every row."""
    import torch
    from tensordict import TensorDict

    for first in range(0, len(trajectories), batch):
        rows = trajectories[first : first + batch]
        columns: dict[str, Any] = {}
        for name in rows[0].token_fields:
            parts = [torch.from_numpy(np.ascontiguousarray(t.token_fields[name])) for t in rows]
            columns[name] = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
        for name in rows[0].scalars:
            columns[name] = torch.from_numpy(np.stack([np.asarray(t.scalars[name]) for t in rows]))
        if rows[0].multimodal:
            columns[IMAGE_FIELD] = torch.from_numpy(np.stack([t.multimodal[0].data for t in rows]))
        keys = [t.trajectory_id for t in rows]
        meta = client.kv_retrieve_meta(keys=keys, partition_id=partition_id, create=True)
        client.put(TensorDict(columns, batch_size=len(rows)), meta)


def read_share_tq(
    client: Any, plan: MiniBatchPlan, rank: RankPosition, partition_id: str
) -> tuple[LocalTrajectories, int]:
    """One rank's DP share through ``kv_retrieve_meta`` + ``get_data``: whole rows of the fields
    training needs (plus the image column on TP0/CP0), nested tensors unbound into numpy.

    Returns the local copies and the payload bytes TQ delivered (every row's image counted).
    """
    group = plan.consumer(rank.dp, rank.cp)
    sequences = [s for mb in group.micro_batches for s in mb.sequences]
    if not sequences:
        return LocalTrajectories({}), 0
    first = group.micro_batches[0]
    fields = [*first.token_fields, *first.scalar_fields]
    if rank.reads_multimodal:
        fields.append(IMAGE_FIELD)
    keys = [s.trajectory_id for s in sequences]
    meta = client.kv_retrieve_meta(keys=keys, partition_id=partition_id, create=False)
    data = client.get_data(meta.select_fields(fields))
    units: dict[UnitKey, np.ndarray] = {}
    moved = 0
    for name in fields:
        column = data[name]
        rows = column.unbind() if column.is_nested else list(column)
        for seq, row in zip(sequences, rows, strict=True):
            array = row.numpy()
            moved += array.nbytes
            if name == IMAGE_FIELD:
                units[seq.multimodal[0].key] = array
            else:
                units[UnitKey(seq.trajectory_id, name)] = array
    return LocalTrajectories(units), moved


def streaming_loader(
    connection: TransferQueueConnection,
    rank: RankPosition,
    fields: Sequence[str],
    rows_per_step: int,
    partition_id: str,
    task_name: str,
    prefetch: int = 0,
) -> Any:
    """TQ's own training path for one rank: a ``StreamingDataLoader`` over a ``StreamingDataset``
    (its ``RankAwareSampler`` gives the TP/CP peers of a DP rank the same rows), one trajectory
    per micro-batch; ``prefetch`` > 0 adds one loader worker fetching that many micro-batches
    ahead (TQ's look-ahead), 0 fetches in the training loop. Needs TQ started with
    ``sampler=RankAwareSampler``."""
    from transfer_queue.dataloader import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(
        config=connection.config,
        batch_size=rows_per_step,
        micro_batch_size=1,
        data_fields=list(fields),
        partition_id=partition_id,
        task_name=task_name,
        dp_rank=rank.dp,
    )
    if not prefetch:
        return StreamingDataLoader(dataset)
    return StreamingDataLoader(dataset, num_workers=1, prefetch_factor=prefetch)


def pack_streamed(
    batch: Any,
    rank: RankPosition,
    topology: Topology,
    token_fields: Sequence[str],
    scalar_fields: Sequence[str],
    buffer: Arena,
    index: int = 0,
) -> tuple[MicroBatchLayout, np.ndarray, dict[str, int]]:
    """Pack one ``StreamingDataLoader`` micro-batch (rows of whole trajectories) for this rank's CP
    share, as ``pack_local`` does, into ``buffer`` (reset first); returns the layout, the packed
    bytes and the payload bytes TQ delivered per column."""
    units: dict[UnitKey, np.ndarray] = {}
    moved: dict[str, int] = {}
    sequences = []
    for name in batch.keys():  # noqa: SIM118 (iterating a TensorDict yields its rows)
        column = batch[name]
        rows = column.unbind() if column.is_nested else list(column)
        moved[name] = 0
        for i, row in enumerate(rows):
            array = row.numpy()
            moved[name] += array.nbytes
            units[UnitKey(f"row{i}", name)] = array
    for i in range(batch.batch_size[0]):
        length = int(units[UnitKey(f"row{i}", token_fields[0])].shape[0])
        padded = int(padded_lengths(np.array([length]), topology.pad_multiple)[0])
        chunks = cp_chunks(padded, topology.cp, rank.cp)
        sequences.append(SequenceSlice(f"row{i}", length, padded, chunks))
    micro_batch = MicroBatchPlan(index, tuple(sequences), tuple(token_fields), tuple(scalar_fields))
    local = LocalTrajectories(units)
    buffer.reset()
    layout = pack_layout(micro_batch, local.schema(micro_batch))
    packed = buffer.take(layout.nbytes)
    pack_into(micro_batch, layout, packed, local.read_into)
    return layout, packed, moved
