"""A tiny vision-language model for the demo: a ViT-style encoder and a context-parallel causal backbone."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class ModelSize:
    """Widths of the demo model; small enough to train several steps on two CPU cores."""

    vocab: int = 64
    patch_dim: int = 48
    encoder_width: int = 96
    hidden: int = 64
    heads: int = 4
    layers: int = 2


class VisionEncoder(nn.Module):
    """Patch embedding, two mixing blocks over a unit's patches, and a projector to the backbone width."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.patch = nn.Linear(size.patch_dim, size.encoder_width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                size.encoder_width, 4, 2 * size.encoder_width, dropout=0.0, batch_first=True
            )
            for _ in range(2)
        )
        self.projector = nn.Linear(size.encoder_width, size.hidden)

    def forward(self, units: list[torch.Tensor]) -> torch.Tensor:
        """One output row per patch of every unit, concatenated in order."""
        rows = []
        for patches in units:
            h = self.patch(patches).unsqueeze(0)
            for block in self.blocks:
                h = block(h)
            rows.append(self.projector(h.squeeze(0)))
        return torch.cat(rows)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence over the CP group; backward keeps this rank's part of the sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` of every CP rank concatenated (CP ranks hold equally many packed tokens)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group)


class Block(nn.Module):
    """Pre-norm causal attention over packed sequences (K/V gathered over CP) and an MLP."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.heads = size.heads
        self.norm1 = nn.LayerNorm(size.hidden)
        self.qkv = nn.Linear(size.hidden, 3 * size.hidden)
        self.out = nn.Linear(size.hidden, size.hidden)
        self.norm2 = nn.LayerNorm(size.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(size.hidden, 4 * size.hidden),
            nn.GELU(),
            nn.Linear(4 * size.hidden, size.hidden),
        )

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, cp_group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        k, v = gather_sequence(k, cp_group), gather_sequence(v, cp_group)
        split = (-1, self.heads, width // self.heads)
        attn = F.scaled_dot_product_attention(
            q.view(split).transpose(0, 1),
            k.view(split).transpose(0, 1),
            v.view(split).transpose(0, 1),
            attn_mask=mask,
        )
        x = x + self.out(attn.transpose(0, 1).reshape(tokens, width))
        return x + self.mlp(self.norm2(x))


class Backbone(nn.Module):
    """Token embedding with encoder features at placeholder positions, causal blocks, LM head."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.hidden)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.hidden)
        self.head = nn.Linear(size.hidden, size.vocab)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        sequence_ids: torch.Tensor,
        features: torch.Tensor,
        feature_at: torch.Tensor,
        cp_group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """Logits ``[T, vocab]`` of this rank's packed tokens; ``features`` replace rows ``feature_at``."""
        x = self.embed(tokens).index_copy(0, feature_at, features.to(self.embed.weight.dtype))
        all_positions = gather_sequence(positions, cp_group)
        all_sequences = gather_sequence(sequence_ids, cp_group)
        same = sequence_ids[:, None] == all_sequences[None, :]
        mask = same & (all_positions[None, :] <= positions[:, None])
        for block in self.blocks:
            x = block(x, mask, cp_group)
        return self.head(self.norm(x))
