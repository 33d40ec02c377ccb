"""TransferQueue sample-level baseline: one TQ row per trajectory, each rank reads its DP share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from knitkit.storage import MiniBatchPlan, Trajectory
from knitkit.storage.baselines import LocalTrajectories, RankPosition
from knitkit.types import UnitKey

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
