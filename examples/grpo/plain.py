"""The reference loop's data path, written without knitkit: each rank loads its share of the admitted trajectories itself.

What a team without knitkit writes: DP rank d takes every DP-th trajectory of the mini-batch,
regenerates it from the rollout's own output (the SGLang ``/generate`` dict and its request)
with plain numpy, and runs one trajectory per micro-batch (``[1, s]``, causal mask). The
vision path re-encodes the trajectory's image inside every micro-batch of every pass, and each
pass's log-probs stay in this rank's memory for the train pass. Nothing here uses knitkit's data
path (``plain_dedup.py`` adds its encoder dedup, nothing else).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from grpo.clock import StepClock
from grpo.config import GRPOConfig
from grpo.loss import token_weights
from grpo.rollout import Group, RolloutConfig, generate_group, parse_trajectory_id
from grpo.train import StepRecord, Trainer, figure_names
from knitkit.integration.megatron import current_device
from knitkit.metrics import MetricsObserver

if TYPE_CHECKING:
    from grpo.plain_dedup import PlainDedup


@dataclass(frozen=True, slots=True)
class Sample:
    """One trajectory as the plain loop trains it (next-token aligned: position t predicts t+1)."""

    trajectory_id: str
    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    """1 where the label is a generated token."""
    image: np.ndarray
    """``[patches, patch_dim]``, one feature row per placeholder token."""
    advantage: float
    reward: float

    @property
    def nbytes(self) -> int:
        """What loading it moved: its tokens and image (labels and mask are derived locally)."""
        return self.tokens.nbytes + self.image.nbytes


def load(config: RolloutConfig, trajectory_id: str) -> Sample:
    """Rebuild one trajectory from the rollout's request and ``/generate`` output."""
    step, index, response = parse_trajectory_id(trajectory_id)
    group = _group(config, step, index)
    request, output = group.requests[response], group.outputs[response]
    prompt = len(request.input_ids)
    tokens = np.asarray([*request.input_ids, *output["output_ids"]], dtype=np.int64)
    labels = np.zeros_like(tokens)
    labels[:-1] = tokens[1:]
    loss_mask = np.zeros(len(tokens), dtype=np.float32)
    loss_mask[prompt - 1 : len(tokens) - 1] = 1.0  # positions whose label was generated
    (image,) = request.images
    return Sample(
        trajectory_id,
        tokens,
        labels,
        loss_mask,
        np.asarray(image),
        group.advantages[response],
        group.rewards[response],
    )


@lru_cache(maxsize=256)
def _group(config: RolloutConfig, step: int, index: int) -> Group:
    return generate_group(config, step, index)


def rank_share(trajectory_ids: Sequence[str], dp_rank: int, dp: int) -> list[str]:
    """This DP rank's trajectories of a mini-batch: every ``dp``-th, in admission order."""
    return list(trajectory_ids[dp_rank::dp])


def batch(sample: Sample, sequences: int, device: torch.device) -> dict[str, object]:
    """One trajectory as a ``[1, s]`` micro-batch; ``sequences`` is the mini-batch's trajectory count."""
    length = len(sample.tokens)
    loss_mask = torch.from_numpy(sample.loss_mask)
    pixels = torch.from_numpy(sample.image).to(device)
    weights = token_weights(loss_mask, torch.tensor([length]), sequences)
    return {
        "tokens": torch.from_numpy(sample.tokens)[None].to(device),
        "labels": torch.from_numpy(sample.labels)[None].to(device),
        "loss_mask": loss_mask[None].to(device),
        "position_ids": torch.arange(length, device=device)[None],
        "attention_mask": torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[
            None, None
        ],
        "images": [(pixels, 0, len(pixels))],
        "advantage": torch.full((1, length), sample.advantage, device=device),
        "reward": torch.full((1, length), sample.reward, device=device),
        "weights": weights[None].to(device),
    }


def plain_loop(
    run: GRPOConfig,
    trainer: Trainer,
    minibatches: Sequence[Sequence[str]],
    observe: MetricsObserver | None = None,
    clock: StepClock | None = None,
    batches_of: Callable[[list[Sample], int, torch.device], list[dict[str, object]]] | None = None,
    dedup: PlainDedup | None = None,
) -> list[StepRecord]:
    """The GRPO steps on ``minibatches`` (trajectory ids per step) without knitkit's data path:
    each pass runs megatron's schedule on this rank's share, log-probs recomputed per step.
    Loading a step's share counts as its data wait (``clock``): nothing overlaps it.
    ``batches_of(samples, sequences, device)`` builds the micro-batches (default: one trajectory
    each, ``batch``; benchmarks/grpo_step.py also packs them). ``dedup`` encodes each unique
    image once per pass of a mini-batch instead of in every micro-batch (``plain_dedup.py``;
    routing it and loading the images it encodes count as the data wait too)."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    device = current_device()
    clock = clock or StepClock()
    history = []
    for step, ids in enumerate(minibatches, 1):
        clock.start()
        with clock.data("load"):
            samples = [load(run.rollout, t) for t in rank_share(ids, dp_rank, dp)]
            batches = (
                batches_of(samples, len(ids), device)
                if batches_of is not None
                else [batch(s, len(ids), device) for s in samples]
            )
            clock.bytes_read += sum(s.nbytes for s in samples)
            if dedup is not None:
                clock.bytes_read += dedup.prepare(ids)
        policy = dedup.for_model(trainer.policy) if dedup is not None else None
        reference = dedup.for_model(trainer.reference) if dedup is not None else None
        old = trainer.logprobs(trainer.policy, batches, len(batches), policy)
        ref = trainer.logprobs(trainer.reference, batches, len(batches), reference)
        train = [
            dict(b, old_logprobs=o["logprobs"], ref_logprobs=r["logprobs"])
            for b, o, r in zip(batches, old, ref, strict=True)
        ]
        figures = trainer.train(train, len(train), policy)
        history.append(StepRecord(step, tuple(sorted(ids)), figures, clock.stop()))
        if observe is not None:
            observe(step, figure_names(figures))
    return history
