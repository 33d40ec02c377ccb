"""Encoder dedup alone, in a plain PyTorch loop: encode each image once per mini-batch, same gradients.

A GRPO mini-batch holds 2 prompts x 4 rollouts; all 4 rollouts of a prompt share its image.
The plain loop encodes the image in every micro-batch that uses it (8 encodes); DedupEncoder
encodes each unique image once, serves detached copies, and runs one deferred encoder backward.

Run: python examples/dedup_plain_pytorch.py
"""

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

torch.manual_seed(0)
PATCHES, PATCH_DIM, HIDDEN = 16, 32, 64
images = {UnitKey(f"img{p}", "image"): torch.randn(PATCHES, PATCH_DIM) for p in range(2)}
keys = list(images)
# 4 backbone micro-batches of 2 trajectories; trajectory t (of 8) belongs to prompt t // 4.
micro_batches = [[keys[t // 4] for t in (2 * m, 2 * m + 1)] for m in range(4)]

encoder = torch.nn.Linear(PATCH_DIM, HIDDEN)
backbone = torch.nn.Linear(HIDDEN, 1)
encoded: list[UnitKey] = []  # every image the encoder ran on


def encode(batch_keys) -> torch.Tensor:
    encoded.extend(batch_keys)
    return encoder(torch.cat([images[k] for k in batch_keys]))


def loss_of(features: torch.Tensor) -> torch.Tensor:
    return backbone(features).pow(2).mean() / len(micro_batches)


# Plain loop: every micro-batch re-encodes the images of its trajectories.
for mb in micro_batches:
    loss_of(encode(mb)).backward()
plain = [p.grad.clone() for p in (*encoder.parameters(), *backbone.parameters())]
plain_encodes = len(encoded)
encoded.clear()
for p in (*encoder.parameters(), *backbone.parameters()):
    p.grad = None

# Dedup: a routing plan from metadata, then Listing 1 of the paper via train_minibatch.
plan = build_routing_plan(
    EncoderAssignment({0: [keys]}, {k: PATCHES for k in keys}),
    BackboneAssignment({0: [[RowSlice(k, 0, PATCHES) for k in mb] for mb in micro_batches]}),
    world_size=1,
)
dedup = DedupEncoder(plan.for_rank(0), LocalTransport(), hidden=HIDDEN)
train_minibatch(dedup, encode, lambda micro, features: loss_of(features))
deduped = [p.grad for p in (*encoder.parameters(), *backbone.parameters())]

diff = max((a - b).abs().max().item() for a, b in zip(plain, deduped, strict=True))
print(f"encoder ran on {plain_encodes} images (plain) vs {len(encoded)} (dedup)")
print(f"max gradient difference: {diff:.2e} ({'equal' if diff < 1e-5 else 'DIFFERENT'})")
