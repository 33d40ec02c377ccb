"""A toy VLM and GRPO mini-batches for the dedup equivalence tests (test helper, not a test module).

Encoder: ViT-style patch embedding + a per-unit mixing layer (rows of one unit depend on each other)
+ projector. Backbone: token embedding with features injected at placeholder positions, one causal
attention block and MLP; TP via megatron-core Column/RowParallelLinear (replicated inputs) and CP via
zigzag sequence chunks with K/V all-gathered over the CP group.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from knitkit.demo.model import gather_sequence
from knitkit.encoder_dedup import RowSlice, row_slices
from knitkit.types import MultimodalRef, SeqRange, UnitKey

PATCH, WIDTH, HIDDEN, HEADS, VOCAB = 6, 12, 16, 2, 32


@dataclass(frozen=True, slots=True)
class Layout:
    """Backbone DP x CP x TP (Megatron order: TP fastest, then CP, then DP) and the encoding ranks."""

    dp: int = 1
    tp: int = 1
    cp: int = 1
    encoder_ranks: tuple[int, ...] | None = None
    """Ranks that run the encoder (the encoder's own DP); ``None`` means every rank."""
    megatron: bool = False
    """Build the backbone from megatron-core TP layers (on CPU through ``knitkit.integration.megatron.cpu``)."""

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp

    def rank(self, d: int, c: int, t: int) -> int:
        return (d * self.cp + c) * self.tp + t

    def coords(self, rank: int) -> tuple[int, int, int]:
        return rank // (self.cp * self.tp), rank // self.tp % self.cp, rank % self.tp


@dataclass(frozen=True, slots=True)
class Trajectory:
    ident: int
    length: int
    refs: tuple[MultimodalRef, ...]


@dataclass(frozen=True, slots=True)
class Piece:
    """Positions ``[start, stop)`` of one trajectory inside a backbone micro-batch."""

    traj: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    layout: Layout
    trajectories: tuple[Trajectory, ...]
    micro_batches: tuple[tuple[tuple[Piece, ...], ...], ...]
    """Per backbone DP rank: its micro-batches of pieces."""
    dtype: str = "float32"
    declare_tp_groups: bool = True
    """False builds a deliberately wrong plan (TP replicas all return full gradients)."""
    device: str = "cpu"


def grpo_case(
    name: str,
    layout: Layout,
    samples: list[list[tuple[str, int]]],
    n: int,
    *,
    length: int = 24,
    micro_size: int = 2,
    dtype: str = "float32",
) -> Case:
    """``n`` trajectories per sample sharing its units ``(kind, rows)``; round-robin over DP ranks."""
    trajectories: list[Trajectory] = []
    for s, units in enumerate(samples):
        refs, at = [], 2
        for j, (kind, rows) in enumerate(units):
            refs.append(MultimodalRef(UnitKey(f"s{s}-u{j}", kind), at, rows, float(rows)))
            at += rows + 1
        assert at <= length, f"sample {s} needs {at} positions"
        trajectories += [Trajectory(len(trajectories), length, tuple(refs)) for _ in range(n)]
    per_dp: list[list[Piece]] = [[] for _ in range(layout.dp)]
    for i, traj in enumerate(trajectories):
        per_dp[i % layout.dp].append(Piece(traj.ident, 0, traj.length))
    micro = tuple(
        tuple(tuple(p[k : k + micro_size]) for k in range(0, len(p), micro_size)) for p in per_dp
    )
    return Case(name, layout, tuple(trajectories), micro, dtype)


def held_ranges(piece: Piece, cp: int, c: int) -> list[SeqRange]:
    """Zigzag CP split of a piece: CP rank c holds chunks c and 2cp-1-c (Megatron's load balance)."""
    size = (piece.stop - piece.start) // (2 * cp)
    assert size * 2 * cp == piece.stop - piece.start, f"{piece} is not divisible by 2*cp={2 * cp}"
    chunks = [c, 2 * cp - 1 - c] if cp > 1 else [0]
    size = size if cp > 1 else piece.stop - piece.start
    return [(piece.start + k * size, piece.start + (k + 1) * size) for k in chunks]


def unit_inputs(case: Case) -> dict[UnitKey, torch.Tensor]:
    """Deterministic patches for every unique unit, identical on every rank."""
    units = {}
    for traj in case.trajectories:
        for ref in traj.refs:
            gen = torch.Generator().manual_seed(zlib.crc32(ref.key.owner.encode()))
            units[ref.key] = torch.randn(ref.num_tokens, PATCH, generator=gen).to(case.device)
    return units


class ToyEncoder(nn.Module):
    """ViT-style: patch embedding, per-unit mixing, projector to the backbone width."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(PATCH, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.projector = nn.Linear(WIDTH, HIDDEN)

    def forward(self, units: list[torch.Tensor]) -> torch.Tensor:
        outs = []
        for x in units:
            h = F.gelu(self.patch(x.to(self.patch.weight.dtype)))
            h = h + self.mix(h.mean(0, keepdim=True))
            outs.append(self.projector(h))
        if not outs:
            return self.patch.weight.new_empty(0, HIDDEN)
        return torch.cat(outs)


class _Plain(nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


@dataclass(slots=True)
class ItemView:
    """One piece as a CP rank sees it: tokens at its positions and where its feature rows go."""

    tokens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    context: torch.Tensor
    feature_at: torch.Tensor
    slices: tuple[RowSlice, ...]
    refs: tuple[MultimodalRef, ...]


def item_view(case: Case, piece: Piece, c: int) -> ItemView:
    cp = case.layout.cp
    traj = case.trajectories[piece.traj]
    gen = torch.Generator().manual_seed(1000 + traj.ident)
    tokens = torch.randint(1, VOCAB, (traj.length,), generator=gen)
    targets = torch.roll(tokens, -1)
    ranges = held_ranges(piece, cp, c)
    positions = torch.cat([torch.arange(a, b) for a, b in ranges])
    context = torch.cat(
        [torch.arange(a, b) for k in range(cp) for a, b in held_ranges(piece, cp, k)]
    )
    slices = row_slices(traj.refs, ranges)
    starts = {ref.key: ref.token_start for ref in traj.refs}
    feature_pos = [starts[s.key] + r for s in slices for r in range(s.start, s.stop)]
    local = {int(p): i for i, p in enumerate(positions)}
    feature_at = torch.tensor([local[p] for p in feature_pos], dtype=torch.int64)
    overlapping = tuple(r for r in traj.refs if any(s.key == r.key for s in slices))
    dev = case.device
    return ItemView(
        tokens[positions].to(dev),
        targets[positions].to(dev),
        positions.to(dev),
        context.to(dev),
        feature_at.to(dev),
        slices,
        overlapping,
    )


class ToyBackbone(nn.Module):
    """Embedding + causal attention + MLP + head; TP layers from megatron-core when asked."""

    def __init__(self, megatron: bool, tp: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.local_heads = HEADS // tp
        if megatron:
            from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

            from knitkit.integration.megatron import cpu as megatron_cpu

            cfg = megatron_cpu.model_parallel_config()
            init = nn.init.xavier_normal_
            col = dict(config=cfg, init_method=init, gather_output=False, bias=True)
            row = dict(
                config=cfg, init_method=init, input_is_parallel=True, bias=True, skip_bias_add=False
            )
            self.qkv = ColumnParallelLinear(HIDDEN, 3 * HIDDEN, **col)
            self.out = RowParallelLinear(HIDDEN, HIDDEN, **row)
            self.fc1 = ColumnParallelLinear(HIDDEN, 2 * HIDDEN, **col)
            self.fc2 = RowParallelLinear(2 * HIDDEN, HIDDEN, **row)
        else:
            self.qkv, self.out = _Plain(HIDDEN, 3 * HIDDEN), _Plain(HIDDEN, HIDDEN)
            self.fc1, self.fc2 = _Plain(HIDDEN, 2 * HIDDEN), _Plain(2 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(
        self,
        items: list[ItemView],
        features: torch.Tensor,
        cp_group: dist.ProcessGroup | None,
        norm: float,
    ) -> torch.Tensor:
        loss = features.new_zeros(()).float()
        at = 0
        for item in items:
            x = self.embed(item.tokens).to(features.dtype)
            rows = len(item.feature_at)
            if rows:
                x = x.index_put((item.feature_at,), features[at : at + rows])
                at += rows
            q, k, v = self.qkv(self.norm1(x))[0].chunk(3, dim=-1)
            if cp_group is not None:
                k, v = gather_sequence(k, cp_group), gather_sequence(v, cp_group)
            heads = lambda t: t.unflatten(-1, (self.local_heads, -1)).transpose(0, 1)  # noqa: E731
            mask = item.positions[:, None] >= item.context[None, :]
            a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask)
            x = x + self.out(a.transpose(0, 1).flatten(1))[0]
            x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))[0]))[0]
            logits = self.head(x).float()
            loss = loss + F.cross_entropy(logits, item.targets, reduction="sum") / norm
        assert at == len(features), f"{len(features)} feature rows, {at} consumed"
        return loss
