"""knitkit's CP split agrees with megatron-core's ``get_batch_on_this_cp_rank`` in a real gloo world."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from knitkit.storage import (
    MemoryBackend,
    PlannerConfig,
    Topology,
    TrajectoryStore,
    pack,
    plan_minibatch,
)
from knitkit.storage.units.payload import Trajectory

LENGTHS = (1, 5, 12, 37, 64, 101)
FIELDS = ("tokens", "routing")


def _compare_on_rank(rank: int, cp: int, group: dist.ProcessGroup, topology: Topology) -> None:
    from megatron.core.utils import get_batch_on_this_cp_rank

    for n in LENGTHS:
        routing = (np.arange(n * 6, dtype=np.int64).reshape(n, 3, 2) % 251).astype(np.uint8)
        store = TrajectoryStore(MemoryBackend())
        store.write(
            Trajectory(
                "t", "s", {"tokens": np.arange(100, 100 + n, dtype=np.int64), "routing": routing}
            )
        )
        plan = plan_minibatch(
            store.metas(), topology, PlannerConfig(token_fields=FIELDS, scalar_fields=())
        )
        (mb,) = plan.consumer(0, rank).micro_batches
        layout, buffer = pack(mb, store.schema("t"), store.read_into)
        ours = layout.numpy_views(buffer)
        padded = mb.sequences[0].padded_length
        full = {
            "tokens": np.zeros(padded, dtype=np.int64),
            "position_ids": np.arange(padded, dtype=np.int64),
            "routing": np.zeros((padded, 3, 2), dtype=np.uint8),
            "loss_mask": (np.arange(padded) < n).astype(np.float32),
        }
        full["tokens"][:n] = np.arange(100, 100 + n)
        full["routing"][:n] = routing
        batch = {k: torch.from_numpy(v).unsqueeze(0) for k, v in full.items()}  # [b=1, s, ...]
        theirs = get_batch_on_this_cp_rank(batch, cp_group=group)
        for name, value in theirs.items():
            np.testing.assert_array_equal(
                ours[name], value.squeeze(0).numpy(), err_msg=f"cp={cp} n={n} {name}"
            )


def _worker(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        _compare_on_rank(rank, 2, group, Topology(dp=1, cp=2))
        _compare_on_rank(rank, 2, group, Topology(dp=1, cp=2, tp=2, sequence_parallel=True))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cp_split_matches_megatron_get_batch_on_this_cp_rank() -> None:
    """For cp=2 (also with SP padding), every rank's packed tokens, position ids, loss mask and
    routing equal what megatron-core's get_batch_on_this_cp_rank gives that rank of the padded
    sequence, in a real 2-process gloo world (the cp group passed explicitly, nothing patched).
    Two processes only: importing megatron costs ~10-20 s per process on this machine."""
    pytest.importorskip(
        "megatron.core", reason="needs megatron-core (pip install knitkit[megatron])"
    )
    mp.spawn(_worker, args=(2, _free_port()), nprocs=2, join=True)
