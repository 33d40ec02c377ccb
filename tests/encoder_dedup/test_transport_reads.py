"""A ``ProcessGroupTransport`` reads its group once (NOTE [ The group read once ]).

A dedup mini-batch asked ``torch.distributed`` for the transport's rank and size about eleven
times (the encoder's checks, each handshake, each row exchange), each a few Python frames deep;
they are fixed for the group's life, so the transport reads them on first use. Counted on a
real two-rank gloo world, over a group of its own (so that peers' global ranks are looked up
too): the ``get_rank`` / ``get_world_size`` / ``get_global_rank`` calls of one mini-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
import torch.distributed as dist
from dist import World

from knitkit.encoder_dedup import (
    BackboneAssignment,
    DedupEncoder,
    EncoderAssignment,
    ProcessGroupTransport,
    RowSlice,
    build_routing_plan,
)
from knitkit.types import UnitKey

UNITS = [UnitKey(name, "image") for name in "ab"]
READS = ("get_rank", "get_world_size", "get_global_rank")


@contextmanager
def _counted_reads() -> Iterator[dict[str, int]]:
    """Calls of each of ``READS`` in ``torch.distributed`` while the block runs (each spy calls
    the real function)."""
    counts: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        spies = {
            name: stack.enter_context(mock.patch.object(dist, name, wraps=getattr(dist, name)))
            for name in READS
        }
        yield counts
        counts.update({name: spy.call_count for name, spy in spies.items()})


def _minibatch_reads(rank: int) -> tuple[dict[str, int], list[list[float]]]:
    """One train mini-batch on a fresh transport over a new group of both ranks (rank r encodes
    unit r, every rank consumes both): the group reads it made, and the routed features."""
    group = dist.new_group([0, 1])
    rows = {key: 2 for key in UNITS}
    encoder = EncoderAssignment({r: [[UNITS[r]]] for r in range(2)}, rows)
    pieces = [RowSlice(key, 0, 2) for key in UNITS]
    backbone = BackboneAssignment({r: [pieces] for r in range(2)})
    route = build_routing_plan(encoder, backbone, world_size=2).for_rank(rank)
    weight = torch.nn.Parameter(torch.ones(1, 2))
    with _counted_reads() as counts:
        dedup = DedupEncoder(
            route, ProcessGroupTransport(group), hidden=2, handshake_timeout_s=30.0
        )
        dedup.encode(lambda keys: weight.expand(2 * len(keys), 2) * (rank + 1))
        features = dedup.features(0)
        features.sum().backward()
        dedup.backward()
    return counts, features.tolist()


def test_a_minibatch_reads_the_group_once(world2: World) -> None:
    """The rank and size read once, each peer's global rank once (11, 11 and 4 calls per
    mini-batch before); the features routed as before."""
    for counts, features in world2.run(_minibatch_reads):
        assert counts == {"get_rank": 1, "get_world_size": 1, "get_global_rank": 2}, counts
        assert features == [[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2
