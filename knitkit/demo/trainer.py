"""One training rank of the demo: prefetched packed micro-batches, deduplicated encoder, GRPO-style loss."""

from __future__ import annotations

import queue
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from knitkit.demo.figures import rank_figures
from knitkit.demo.model import Backbone, ModelSize, VisionEncoder
from knitkit.encoder_dedup import (
    DedupEncoder,
    ProcessGroupTransport,
    RoutingPlan,
    route_minibatch,
    row_slices,
)
from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.storage import MicroBatchConsumer, MicroBatchPlan, MiniBatchPlan, RingSpec
from knitkit.types import UnitKey


@dataclass(frozen=True, slots=True)
class RankSetup:
    """What every training rank is started with; plans arrive later, one per mini-batch."""

    world: int
    cp: int
    port: int
    backbone_rings: tuple[RingSpec, ...]
    """Indexed by global rank (= dp * cp + cp_rank)."""
    encoder_rings: tuple[RingSpec, ...]
    """Indexed by encoder DP rank; encoder rank e runs on global rank ``encoder_ranks[e]``."""
    encoder_ranks: tuple[int, ...]
    size: ModelSize
    lr: float
    prefetch_depth: int
    seed: int = 0


@dataclass(slots=True)
class StepResult:
    """What one rank measured on one mini-batch (the driver sums or averages over ranks)."""

    rank: int
    minibatch_id: str
    loss: float
    micro_batches: int
    exposed_wait_s: float
    stage_s: float
    step_s: float
    dedup_encoder_s: float
    dup_encoder_s: float
    units_encoded: int
    dup_units_encoded: int
    grad_norm: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    """This rank's ``knitkit/...`` figures after the step (``figures.rank_figures``)."""


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


def run_rank(rank: int, setup: RankSetup, plans: queue.Queue, results: queue.Queue) -> None:
    """Entry point of one spawned training process; trains until the driver sends ``None``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{setup.port}", rank=rank, world_size=setup.world
    )
    try:
        _train(rank, setup, plans, results)
    except BaseException:
        results.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def _train(rank: int, setup: RankSetup, plans: queue.Queue, results: queue.Queue) -> None:
    consumer = MicroBatchConsumer(setup.backbone_rings[rank], 0)
    config = MicroBatchIterator.Config(depth=setup.prefetch_depth, slot_nbytes=1 << 20)
    with config.build(consumer, device="cpu") as micro_batches:
        trainer = DemoRank(rank, setup, micro_batches, consumer)
        while (plan := plans.get()) is not None:
            results.put(trainer.step(plan))
        trainer.close()


class DemoRank:
    """One training rank's model, optimizer and data handles; ``step`` trains one mini-batch."""

    def __init__(
        self,
        rank: int,
        setup: RankSetup,
        micro_batches: MicroBatchIterator,
        consumer: MicroBatchConsumer,
    ) -> None:
        """``micro_batches`` prefetches from ``consumer``, this rank's backbone ring."""
        self.rank, self.setup, self.micro_batches = rank, setup, micro_batches
        self.consumer = consumer
        cp_groups = [
            dist.new_group(list(range(d * setup.cp, (d + 1) * setup.cp)))
            for d in range(setup.world // setup.cp)
        ]
        self.cp_group = cp_groups[rank // setup.cp]
        torch.manual_seed(setup.seed)
        self.encoder, self.backbone = VisionEncoder(setup.size), Backbone(setup.size)
        self.params = [*self.encoder.parameters(), *self.backbone.parameters()]
        self.optimizer = torch.optim.Adam(self.params, lr=setup.lr)
        self.units_in = (
            MicroBatchConsumer(setup.encoder_rings[setup.encoder_ranks.index(rank)], 0)
            if rank in setup.encoder_ranks
            else None
        )

    def close(self) -> None:
        if self.units_in is not None:
            self.units_in.close()

    def _encoder_inputs(self, plan: MiniBatchPlan) -> dict[UnitKey, torch.Tensor]:
        """The unique units this rank encodes, pulled from its encoder ring (one micro-batch per
        encoder micro-batch of its plan, as its reorganizer publishes them)."""
        if self.units_in is None:
            return {}
        encoder_rank = self.setup.encoder_ranks.index(self.rank)
        pixels: dict[UnitKey, torch.Tensor] = {}
        for _ in plan.encoders[0].ranks[encoder_rank].micro_batches:
            delivered = self.units_in.next_micro_batch()
            units = delivered.layout.unit_views(delivered.buffer)
            pixels.update((key, torch.from_numpy(view.copy())) for key, view in units.items())
            delivered.release()
        return pixels

    def step(self, plan: MiniBatchPlan) -> StepResult:
        """Encode the mini-batch's unique images, train its micro-batches, run one optimizer step."""
        start = time.perf_counter()
        route = routing_plan(plan, self.setup.encoder_ranks, self.setup.world).for_rank(self.rank)
        pixels = self._encoder_inputs(plan)
        dup_s, dup_units = _time_duplicate_encoding(plan, self.encoder, pixels)
        dedup = DedupEncoder(route, ProcessGroupTransport(), hidden=self.setup.size.hidden)
        forward_s = 0.0

        def encode(keys: Sequence[UnitKey]) -> torch.Tensor:
            nonlocal forward_s
            t0 = time.perf_counter()
            out = self.encoder([pixels[k] for k in keys])
            forward_s += time.perf_counter() - t0
            return out

        dedup.encode(encode)
        consumer = plan.consumer(self.rank // self.setup.cp, self.rank % self.setup.cp)
        norm = float(
            sum(
                s.num_tokens
                for c in plan.consumers
                if c.cp_rank == 0
                for mb in c.micro_batches
                for s in mb.sequences
            )
        )
        total_loss = 0.0
        wait_before, stage_before = (
            self.micro_batches.stats.wait_s,
            self.micro_batches.stats.stage_s,
        )
        for index, mb_plan in enumerate(consumer.micro_batches):
            mb = next(self.micro_batches)
            feature_at, sequence_ids = feature_positions(mb_plan)
            logits = self.backbone(
                mb["tokens"],
                mb["position_ids"],
                torch.from_numpy(sequence_ids),
                dedup.features(index),
                torch.from_numpy(feature_at),
                self.cp_group,
            )
            logp = F.log_softmax(logits.float(), -1).gather(-1, mb["labels"][:, None]).squeeze(-1)
            advantage = mb["advantage"].repeat_interleave(
                torch.from_numpy(np.bincount(sequence_ids))
            )
            ratio = torch.exp(logp - mb["old_logprobs"])
            loss = -(ratio * advantage * mb["loss_mask"]).sum() / norm
            loss.backward()
            total_loss += float((-(logp * mb["loss_mask"]).sum() / norm).detach())
        # The barrier keeps waiting for slower ranks' backbone work out of the timed backward,
        # which is the gradient return plus the one deferred encoder backward.
        dist.barrier()
        t0 = time.perf_counter()
        dedup.backward()
        backward_s = time.perf_counter() - t0
        grad_norm = _all_reduce_gradients(self.params)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.tensor([total_loss])
        dist.all_reduce(loss_sum)
        return StepResult(
            rank=self.rank,
            minibatch_id=plan.minibatch_id,
            loss=float(loss_sum),
            micro_batches=len(consumer.micro_batches),
            exposed_wait_s=self.micro_batches.stats.wait_s - wait_before,
            stage_s=self.micro_batches.stats.stage_s - stage_before,
            step_s=time.perf_counter() - start,
            dedup_encoder_s=forward_s + backward_s,
            dup_encoder_s=dup_s,
            units_encoded=dedup.encoded_units,
            dup_units_encoded=dup_units,
            grad_norm=grad_norm,
            metrics=rank_figures(
                self.micro_batches, [c for c in (self.consumer, self.units_in) if c], dedup
            ),
        )


def _all_reduce_gradients(params: list[torch.nn.Parameter]) -> float:
    """Sum gradients over DP x CP (the loss is normalised by the mini-batch's token count)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return float(flat.norm())


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
