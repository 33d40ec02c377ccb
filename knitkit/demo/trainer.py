"""One training rank of the demo: a RankHandle's passes, a deduplicated encoder, a GRPO-style loss."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from knitkit.demo.model import Backbone, ModelSize, VisionEncoder
from knitkit.encoder_dedup import (
    DedupEncoder,
    ProcessGroupTransport,
    RankRoute,
    RoutingPlan,
    route_minibatch,
    row_slices,
    segment_ids,
)
from knitkit.job import Output, Pass, PassWork, RankCoords, RankHandle, RankSpec
from knitkit.microbatch_iter import MicroBatch
from knitkit.storage import MicroBatchPlan, MiniBatchPlan
from knitkit.types import UnitKey

PASSES = (
    Pass(
        "old_logprobs",
        reads=("tokens", "labels"),
        writes=(Output("old_logprobs"),),
        forward_only=True,
        encodes=True,
    ),
    Pass(
        "train",
        reads=("tokens", "labels", "loss_mask", "routing", "advantage", "old_logprobs"),
        encodes=True,
    ),
)
"""The demo's step: old log-probs with the current weights (forward-only, written back), then
the PPO-ratio training pass that reads them."""

LOSS = "knitkit/demo/loss"


@dataclass(frozen=True, slots=True)
class RankSetup:
    """What every training rank is started with: the driver's spec and the model's shape."""

    spec_json: str
    world: int
    cp: int
    port: int
    encoder_ranks: tuple[int, ...]
    """Encoder DP rank e runs on global rank ``encoder_ranks[e]``."""
    size: ModelSize
    lr: float
    prefetch_depth: int
    seed: int = 0


def routing_plan(plan: MiniBatchPlan, encoder_ranks: Sequence[int], world: int) -> RoutingPlan:
    """The dedup routing plan of a mini-batch: encoder ranks' units -> every backbone rank's rows."""
    backbone = {c.dp_rank * plan.topology.cp + c.cp_rank: c for c in plan.consumers}
    encoder = plan.encoders[0].ranks
    return route_minibatch(backbone, encoder, world_size=world, encoder_ranks=encoder_ranks)


def feature_positions(mb: MicroBatchPlan) -> tuple[np.ndarray, np.ndarray]:
    """Packed row of every feature row (in ``row_slices`` order) and the sequence id of every token."""
    at: list[int] = []
    sequence_ids: list[np.ndarray] = []
    offset = 0
    for index, seq in enumerate(mb.sequences):
        local = {p: offset + i for i, p in enumerate(p for a, b in seq.chunks for p in range(a, b))}
        starts = {ref.key: ref.token_start for ref in seq.multimodal}
        for piece in row_slices(seq.multimodal, seq.chunks):
            at.extend(local[starts[piece.key] + r] for r in range(piece.start, piece.stop))
        sequence_ids.append(np.full(seq.local_length, index, np.int64))
        offset += seq.local_length
    return np.asarray(at, np.int64), np.concatenate(sequence_ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_rank(rank: int, setup: RankSetup) -> None:
    """Entry point of one spawned training process: every pass the driver serves, then exit.

    An error inside a pass reaches the driver with its traceback (``PassWork``), so the main
    process fails with it too.
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{setup.port}", rank=rank, world_size=setup.world
    )
    try:
        spec = RankSpec.from_json(setup.spec_json)
        encoder = setup.encoder_ranks.index(rank) if rank in setup.encoder_ranks else None
        coords = RankCoords(rank, rank // setup.cp, rank % setup.cp, encoder_rank=encoder)
        route = routing_plan_for(setup, rank)
        config = RankHandle.Config(depth=setup.prefetch_depth, slot_nbytes=1 << 20)
        with RankHandle(spec, coords, config, device="cpu", route=route) as handle:
            trainer = DemoRank(rank, setup, handle)
            for work in handle.passes():
                with work:
                    trainer.run(work)
    finally:
        dist.destroy_process_group()


def routing_plan_for(setup: RankSetup, rank: int) -> Callable[[MiniBatchPlan], RankRoute]:
    """This rank's route function: its share of the mini-batch's routing plan."""

    def route(plan: MiniBatchPlan) -> RankRoute:
        return routing_plan(plan, setup.encoder_ranks, setup.world).for_rank(rank)

    return route


class DemoRank:
    """One training rank's model and optimizer; ``run`` does one pass of one mini-batch."""

    def __init__(self, rank: int, setup: RankSetup, handle: RankHandle) -> None:
        self.rank, self.setup, self.handle = rank, setup, handle
        cp_groups = [
            dist.new_group(list(range(d * setup.cp, (d + 1) * setup.cp)))
            for d in range(setup.world // setup.cp)
        ]
        self.cp_group = cp_groups[rank // setup.cp]
        torch.manual_seed(setup.seed)
        self.encoder, self.backbone = VisionEncoder(setup.size), Backbone(setup.size)
        self.params = [*self.encoder.parameters(), *self.backbone.parameters()]
        self.optimizer = torch.optim.Adam(self.params, lr=setup.lr)

    def run(self, work: PassWork) -> None:
        """Encode the pass's unique images once (dedup), run its micro-batches; the forward-only
        pass writes the old log-probs back, the train pass steps the optimizer."""
        start = time.perf_counter()
        pixels = work.encoder_inputs()
        dedup = DedupEncoder(work.route, ProcessGroupTransport(), hidden=self.setup.size.hidden)
        encode_s = 0.0

        def encode(keys: Sequence[UnitKey]) -> torch.Tensor:
            nonlocal encode_s
            t0 = time.perf_counter()
            out = self.encoder([pixels[k] for k in keys])
            encode_s += time.perf_counter() - t0
            return out

        figures: dict[str, float] = {}
        if work.forward_only:
            with torch.no_grad():
                dedup.encode(encode, keep_graph=False)
                for index, mb in enumerate(work.micro_batches()):
                    logp, _ = self._log_probs(work, index, mb, dedup)
                    work.write_back(index, {"old_logprobs": logp})
        else:
            dup_s, dup_units = _time_duplicate_encoding(work.plan, self.encoder, pixels)
            dedup.encode(encode)
            loss = self._train(work, dedup)
            # The barrier keeps waiting for slower ranks' backbone work out of the timed
            # backward, which is the gradient return plus the one deferred encoder backward.
            dist.barrier()
            t0 = time.perf_counter()
            dedup.backward()
            encode_s += time.perf_counter() - t0
            _all_reduce_gradients(self.params)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.tensor([loss])
            dist.all_reduce(loss_sum)
            figures = {
                "knitkit/demo/dup_encoder_s": dup_s,
                "knitkit/demo/dup_units": float(dup_units),
                "knitkit/demo/dedup_encoder_s": encode_s,
                "knitkit/demo/dedup_units": float(dedup.encoded_units),
                "knitkit/demo/step_s": time.perf_counter() - start,
            }
            if self.rank == 0:  # every rank holds the all-reduced loss: one reports it
                figures[LOSS] = float(loss_sum)
            figures.update(self.handle.metrics())  # cumulative: once per mini-batch
        work.report({**figures, **dedup.metrics()})

    def _log_probs(
        self, work: PassWork, index: int, mb: MicroBatch, dedup: DedupEncoder
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Per-token log-probs of the labels on this rank's packed tokens, and sequence ids."""
        feature_at, sequence_ids = feature_positions(work.consumer.micro_batches[index])
        logits = self.backbone(
            mb["tokens"],
            mb["position_ids"],
            torch.from_numpy(sequence_ids),
            dedup.features(index),
            torch.from_numpy(feature_at),
            self.cp_group,
        )
        labels = mb["labels"][:, None]
        logp = F.log_softmax(logits.float(), -1).gather(-1, labels).squeeze(-1)
        return logp, sequence_ids

    def _train(self, work: PassWork, dedup: DedupEncoder) -> float:
        """PPO-ratio loss against the written-back old log-probs, over the pass's micro-batches."""
        norm = float(
            sum(
                s.num_tokens
                for c in work.plan.consumers
                if c.cp_rank == 0
                for mb in c.micro_batches
                for s in mb.sequences
            )
        )
        total = 0.0
        for index, mb in enumerate(work.micro_batches()):
            logp, sequence_ids = self._log_probs(work, index, mb, dedup)
            advantage = mb["advantage"].index_select(
                0, segment_ids(torch.from_numpy(np.bincount(sequence_ids)))
            )
            ratio = torch.exp(logp - mb["old_logprobs"])
            loss = -(ratio * advantage * mb["loss_mask"]).sum() / norm
            loss.backward()
            total += float((-(logp * mb["loss_mask"]).sum() / norm).detach())
        return total


def _all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum gradients over DP x CP (the loss is normalised by the mini-batch's token count)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def _time_duplicate_encoding(
    plan: MiniBatchPlan, encoder: VisionEncoder, pixels: dict[UnitKey, torch.Tensor]
) -> tuple[float, int]:
    """Encoder forward+backward time of the non-dedup baseline for the units this rank holds.

    Without dedup every backbone micro-batch on every (DP, CP) rank re-encodes the inputs of each
    trajectory it holds, so a unit is encoded once per referencing trajectory and CP rank. This
    rank times exactly that many encodings of its own units (its share of the baseline's work);
    the gradients are thrown away.
    """
    references = [
        ref.key
        for consumer in plan.consumers
        for mb in consumer.micro_batches
        for seq in mb.sequences
        for ref in seq.multimodal
        if ref.key in pixels
    ]
    if not references:
        return 0.0, 0
    t0 = time.perf_counter()
    out = encoder([pixels[k] for k in references])
    out.sum().backward()
    elapsed = time.perf_counter() - t0
    encoder.zero_grad(set_to_none=True)
    return elapsed, len(references)
