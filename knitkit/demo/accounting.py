"""Bytes the demo's passes consume, and what a sample-level read of the same passes would move."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from knitkit.job import Pass
from knitkit.storage import MiniBatchPlan, TrajectoryStore
from knitkit.storage.baselines import RankPosition, share_reads
from knitkit.types import UnitKey


@dataclass(slots=True)
class BytesMoved:
    """Totals over every admitted mini-batch and pass."""

    consumed: int = 0
    """Payload bytes the ranks' micro-batches and encoder inputs hold (padding excluded)."""
    sample_level: int = 0
    """Bytes a sample-level loader reads for the same passes (whole units of its DP share on
    every rank, each trajectory's images on TP0/CP0)."""


def account(
    moved: BytesMoved, store: TrajectoryStore, plan: MiniBatchPlan, passes: Sequence[Pass]
) -> None:
    """Add one admitted mini-batch's bytes, pass by pass (each pass reads its fields again; the
    ranks get the images once, with the first pass that encodes, where a sample-level loader
    reads them again for every pass that encodes). Written-back fields count with their declared
    dtype: when the mini-batch is admitted they are not written yet."""
    if not plan.consumers:
        return
    row_bytes = {
        f.name: np.dtype(f.dtype).itemsize * math.prod(f.shape) for f in plan.consumers[0].schema
    }
    tokens = {
        s.trajectory_id: s.num_tokens
        for c in plan.consumers
        for mb in c.micro_batches
        for s in mb.sequences
    }
    scalars = (
        set(plan.consumers[0].micro_batches[0].scalar_fields) if plan.num_micro_batches else set()
    )

    def nbytes(key: UnitKey) -> int:
        if key.field in scalars:
            return row_bytes[key.field]
        if key.field in row_bytes:
            return tokens[key.owner] * row_bytes[key.field]
        return store.backend.spec(key).nbytes  # a multimodal input

    encoded = False
    for p in passes:
        mine = plan.with_fields(p.reads)
        for consumer in mine.consumers:
            for read in consumer.reads():
                whole = nbytes(read.key)
                moved.consumed += (
                    whole
                    if read.ranges is None
                    else row_bytes[read.key.field] * sum(b - a for a, b in read.ranges)
                )
            position = RankPosition(consumer.dp_rank, consumer.cp_rank, 0)
            keys = share_reads(mine, position)
            if not p.encodes:
                keys = [k for k in keys if k.field in row_bytes]
            moved.sample_level += sum(nbytes(k) for k in keys)
        if p.encodes and not encoded:
            # kept by the ranks for later passes:
            # NOTE [ Encoder inputs once per mini-batch ] in knitkit/job/rank.py
            encoded = True
            for rank in mine.encoders[0].ranks:
                moved.consumed += sum(store.backend.spec(k).nbytes for k in rank.units)
