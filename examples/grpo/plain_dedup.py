"""The plain loop with encoder dedup only: one trajectory per micro-batch, each unique image encoded once per mini-batch.

The data path stays the plain loop's (``plain.py``: each rank loads its share itself, one
trajectory per micro-batch, nothing packed); only the vision path changes: ``knitkit.encoder_dedup``
(its public routing plan) and the Megatron ``DedupVLMStep`` encode every GRPO group's image
once per pass of a mini-batch, on one rank of the world, and route its rows to every micro-batch
that holds it. So knitkit against this loop measures packing plus the data path, not dedup
(``benchmarks/grpo_step.py``'s ``plain_dedup``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grpo.plain import _group, rank_share
from grpo.rollout import RolloutConfig, parse_trajectory_id, sample_id
from grpo.train import Dedup
from knitkit.encoder_dedup import (
    BackboneAssignment,
    EncoderAssignment,
    RankRoute,
    RowSlice,
    build_routing_plan,
)
from knitkit.integration.megatron import DedupVLMStep, MegatronLayout, current_device
from knitkit.types import UnitKey


def image_key(trajectory_id: str) -> UnitKey:
    """The image of a trajectory's GRPO group: its prompt's (every response shares it)."""
    step, index, _ = parse_trajectory_id(trajectory_id)
    return UnitKey(sample_id(step, index), "image")


def dedup_route(ids: Sequence[str], rows: dict[UnitKey, int], layout: MegatronLayout) -> RankRoute:
    """This rank's route for a mini-batch of the plain loop (pure; alike on every rank): world
    rank ``r`` trains its DP rank's share one trajectory per micro-batch (``rank_share``), each
    micro-batch's features are its group's image rows; the unique images are spread over the
    world ranks round-robin in first-seen order, each encoded once."""
    world, dp = len(layout.coords), layout.topology.dp
    backbone = {
        r: [(RowSlice(key, 0, rows[key]),) for key in map(image_key, rank_share(ids, d, dp))]
        for r, (d, _, _) in enumerate(layout.coords)
    }
    replicas: dict[tuple[int, int], list[int]] = {}
    for r, (d, c, _) in enumerate(layout.coords):
        replicas.setdefault((d, c), []).append(r)
    unique = list(dict.fromkeys(image_key(t) for t in ids))
    encoder = {r: [unique[r::world]] if unique[r::world] else [] for r in range(world)}
    plan = build_routing_plan(
        EncoderAssignment(encoder, rows),
        BackboneAssignment(backbone, tuple(replicas.values())),
        world,
    )
    return plan.for_rank(layout.rank)


class PlainDedup:
    """Per mini-batch: this rank's dedup route and the images it encodes (``prepare``); per
    pass: the ``Dedup`` that runs a model's schedule with them (``for_model``)."""

    def __init__(self, config: RolloutConfig) -> None:
        self.config = config
        self.layout = MegatronLayout.from_parallel_state()
        self._steps: dict[int, DedupVLMStep] = {}
        self._route: RankRoute | None = None
        self._pixels: dict[UnitKey, torch.Tensor] = {}

    def prepare(self, ids: Sequence[str]) -> int:
        """Route the mini-batch ``ids`` and load the images this rank encodes; returns their
        bytes (the rollout's outputs, as ``plain.load`` reads them)."""
        groups = {image_key(t): parse_trajectory_id(t)[:2] for t in ids}
        images = {k: _group(self.config, *g).requests[0].images[0] for k, g in groups.items()}
        rows = {k: len(image) for k, image in images.items()}
        self._route = dedup_route(ids, rows, self.layout)
        mine = [k for mb in self._route.encoder_micro_batches for k in mb]
        device = current_device()
        self._pixels = {k: torch.from_numpy(images[k]).to(device) for k in mine}
        return sum(images[k].nbytes for k in mine)

    def for_model(self, model: Any) -> Dedup:
        """What ``Trainer.logprobs`` / ``train`` need to run ``model``'s pass with dedup."""
        if self._route is None:
            raise RuntimeError("PlainDedup.prepare(ids) routes a mini-batch before its passes")
        step = self._steps.setdefault(id(model), DedupVLMStep(model, vision="vision"))
        vision, pixels = model.module.vision, self._pixels

        def encode(keys: Sequence[UnitKey]) -> torch.Tensor:
            return torch.cat([vision.encode(pixels[k]) for k in keys])

        return Dedup(step, self._route, encode)
