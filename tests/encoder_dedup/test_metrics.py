"""DedupEncoder.metrics(): the dedup figures a trainer logs per mini-batch (issue 19, metrics hooks)."""

from __future__ import annotations

import torch

from knitkit.encoder_dedup import (
    BackboneAssignment,
    DedupEncoder,
    EncoderAssignment,
    LocalTransport,
    RowSlice,
    build_routing_plan,
    train_minibatch,
)
from knitkit.types import UnitKey

A, B = UnitKey("a", "image"), UnitKey("b", "image")


def test_metrics_count_units_rows_and_time() -> None:
    """Two unique units (4 + 2 rows) consumed three times over two micro-batches: 2 units and 6
    rows encoded, 6 rows cached, 4 + 2 + 4 = 10 rows served; both phases timed; flat floats
    under ``knitkit/dedup/``."""
    encoder = EncoderAssignment({0: [[A, B]]}, {A: 4, B: 2})
    backbone = BackboneAssignment(
        {0: [[RowSlice(A, 0, 4), RowSlice(B, 0, 2)], [RowSlice(A, 0, 4)]]}
    )
    route = build_routing_plan(encoder, backbone, world_size=1).for_rank(0)
    dedup = DedupEncoder(route, LocalTransport(), hidden=3)
    weight = torch.nn.Parameter(torch.ones(1, 3))
    rows = {A: 4, B: 2}
    train_minibatch(
        dedup,
        lambda keys: weight.expand(sum(rows[k] for k in keys), 3) * 2.0,
        lambda micro, features: features.square().mean(),
    )
    figures = dedup.metrics()
    assert all(k.startswith("knitkit/dedup/") for k in figures), figures
    assert all(type(v) is float for v in figures.values()), figures
    counts = {k: v for k, v in figures.items() if not k.endswith("_s")}
    assert counts == {
        "knitkit/dedup/units_encoded": 2.0,
        "knitkit/dedup/rows_encoded": 6.0,
        "knitkit/dedup/rows_cached": 6.0,
        "knitkit/dedup/rows_served": 10.0,
    }
    assert figures["knitkit/dedup/encode_s"] > 0 and figures["knitkit/dedup/backward_s"] > 0
