"""A mini-batch train step that reads like the paper's Listing 1, for trainers that are not Megatron."""

from __future__ import annotations

from collections.abc import Callable

import torch

from knitkit.encoder_dedup.dedup import DedupEncoder, EncodeFn

BackboneStep = Callable[[int, torch.Tensor], torch.Tensor]
"""``(micro_batch, features) -> loss`` of one backbone micro-batch, already normalised."""


def train_minibatch(
    dedup: DedupEncoder,
    encoder: EncodeFn,
    backbone: BackboneStep,
    *,
    finalize: Callable[[], None] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.Tensor:
    """Encode unique inputs once, run every backbone micro-batch, one deferred encoder backward, step.

    ``finalize`` reduces gradients (DP all-reduce, ``sync_encoder_grads``); with ``optimizer``
    the step runs last and the gradients are zeroed first. Returns the micro-batch losses as one
    detached tensor ``[num_micro_batches]`` on the losses' device, stacked once at the end: no
    host sync per micro-batch (``float(loss)`` would wait for the GPU each time); call
    ``.tolist()`` where floats are wanted, once per mini-batch.
    """
    if optimizer is not None:
        optimizer.zero_grad()
    dedup.encode(encoder)  # encode unique inputs; retain graphs; route detached rows
    losses: list[torch.Tensor] = []
    for micro in range(len(dedup.route.micro_batch_index)):
        features = dedup.features(micro)  # cache[ids].detach().requires_grad_()
        loss = backbone(micro, features)
        loss.backward()  # leaf grads land in cache_grad by index_add_
        losses.append(loss.detach())
        del features, loss  # release micro-batch-local copies
    dedup.backward()  # owned slices -> encoding ranks -> one deferred encoder backward
    if finalize is not None:
        finalize()
    if optimizer is not None:
        optimizer.step()
    return torch.stack(losses) if losses else torch.zeros(0)
