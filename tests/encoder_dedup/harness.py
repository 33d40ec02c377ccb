"""Per-rank equivalence run: the non-dedup baseline vs knitkit's dedup on one Case (test helper)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from encoder_dedup.toy import Case, ItemView, ToyBackbone, ToyEncoder, item_view, unit_inputs
from knitkit.encoder_dedup import (
    BackboneAssignment,
    DedupEncoder,
    EncoderAssignment,
    LocalTransport,
    ProcessGroupTransport,
    RoutingPlan,
    build_routing_plan,
    sync_encoder_grads,
    train_minibatch,
)
from knitkit.types import UnitKey

Report = dict[str, tuple[float, float]]
"""Parameter name -> (norm of the difference, norm of the baseline gradient)."""


def plan_for(case: Case) -> RoutingPlan:
    """The dedup routing plan of a case: encoder round-robin over its ranks, backbone per (DP, CP, TP)."""
    layout = case.layout
    keys = sorted({ref.key for t in case.trajectories for ref in t.refs})
    rows = {ref.key: ref.num_tokens for t in case.trajectories for ref in t.refs}
    enc_ranks = layout.encoder_ranks or tuple(range(layout.world))
    per_rank: dict[int, list[UnitKey]] = {
        r: keys[i :: len(enc_ranks)] for i, r in enumerate(enc_ranks)
    }
    encoder = EncoderAssignment(
        {r: [ks[j : j + 2] for j in range(0, len(ks), 2)] for r, ks in per_rank.items()}, rows
    )
    consumed = {}
    for rank in range(layout.world):
        d, c, _ = layout.coords(rank)
        consumed[rank] = [
            [s for piece in mb for s in item_view(case, piece, c).slices]
            for mb in case.micro_batches[d]
        ]
    tp_groups = [
        [layout.rank(d, c, t) for t in range(layout.tp)]
        for d in range(layout.dp)
        for c in range(layout.cp)
    ]
    backbone = BackboneAssignment(consumed, tp_groups if case.declare_tp_groups else ())
    return build_routing_plan(encoder, backbone, layout.world)


def run_case(rank: int, case: Case) -> tuple[Report, int, int]:
    """Gradients of baseline and dedup on this rank; returns (report, baseline encodes, dedup encodes)."""
    layout = case.layout
    torch.manual_seed(0)
    dp_cp_group, cp_group, own = _groups(rank, case) if layout.world > 1 else (None, None, [])
    if layout.megatron:
        import megatron_cpu

        megatron_cpu.initialize_model_parallel(
            tensor_parallel=layout.tp, context_parallel=layout.cp
        )
    try:
        dtype = getattr(torch, case.dtype)
        encoder, backbone = (
            ToyEncoder().to(case.device, dtype),
            ToyBackbone(layout.megatron, layout.tp).to(case.device, dtype),
        )
        units = unit_inputs(case)
        d, c, _ = layout.coords(rank)
        views = [[item_view(case, p, c) for p in mb] for mb in case.micro_batches[d]]
        norm = float(sum(t.length for t in case.trajectories))
        params = dict(_named(encoder, backbone))

        base_encodes = 0
        for items in views:
            feats, count = _baseline_features(encoder, units, items)
            base_encodes += count
            backbone(items, feats, cp_group, norm).backward()
        _reduce(params.values(), dp_cp_group)
        baseline = {name: p.grad.clone() for name, p in params.items() if p.grad is not None}
        for p in params.values():
            p.grad = None

        transport = ProcessGroupTransport() if layout.world > 1 else LocalTransport()
        dedup = DedupEncoder(
            plan_for(case).for_rank(rank),
            transport,
            hidden=encoder.projector.out_features,
            dtype=dtype,
            device=case.device,
        )

        def finalize() -> None:
            _reduce(backbone.parameters(), dp_cp_group)
            sync_encoder_grads(encoder.parameters())

        train_minibatch(
            dedup,
            lambda keys: encoder([units[k] for k in keys]),
            lambda i, feats: backbone(views[i], feats, cp_group, norm),
            finalize=finalize,
        )
        report = {
            name: (
                float((p.grad.float() - baseline[name].float()).norm()),
                float(baseline[name].float().norm()),
            )
            for name, p in params.items()
            if name in baseline and p.grad is not None
        }
        missing = set(baseline) ^ {n for n, p in params.items() if p.grad is not None}
        assert not missing, f"gradients present on one side only: {sorted(missing)}"
        return report, base_encodes, dedup.encoded_units
    finally:
        if layout.megatron:
            import megatron_cpu

            megatron_cpu.destroy_model_parallel()
        for group in own:
            dist.destroy_process_group(group)


def _named(encoder: ToyEncoder, backbone: ToyBackbone) -> Iterable[tuple[str, torch.nn.Parameter]]:
    yield from (("encoder." + n, p) for n, p in encoder.named_parameters())
    yield from (("backbone." + n, p) for n, p in backbone.named_parameters())


def _baseline_features(
    encoder: ToyEncoder, units: dict[UnitKey, torch.Tensor], items: list[ItemView]
) -> tuple[torch.Tensor, int]:
    """Non-dedup baseline: the micro-batch encodes every input of every item again, then picks rows."""
    keys = [ref.key for item in items for ref in item.refs]
    out = encoder([units[k] for k in keys])
    blocks, at = [], 0
    for item in items:
        mine = {}
        for ref in item.refs:
            mine[ref.key] = out[at : at + ref.num_tokens]
            at += ref.num_tokens
        blocks += [mine[s.key][s.start : s.stop] for s in item.slices]
    return (torch.cat(blocks) if blocks else out[:0]), len(keys)


def _reduce(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """The trainer's own DP x CP reduction (SUM, as the loss is normalised by the global token count)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if group is not None:
            dist.all_reduce(p.grad, group=group)


def _groups(
    rank: int, case: Case
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, list[dist.ProcessGroup]]:
    """DP x CP group (same TP index) and CP group of this rank; every rank creates every group."""
    layout = case.layout
    d, _, t = layout.coords(rank)
    own: list[dist.ProcessGroup] = []
    dp_cp = cp = None
    for tt in range(layout.tp):
        g = dist.new_group(
            [layout.rank(dd, cc, tt) for dd in range(layout.dp) for cc in range(layout.cp)]
        )
        own.append(g)
        dp_cp = g if tt == t else dp_cp
    for dd in range(layout.dp):
        for tt in range(layout.tp):
            g = dist.new_group([layout.rank(dd, cc, tt) for cc in range(layout.cp)])
            own.append(g)
            cp = g if (dd, tt) == (d, t) else cp
    return dp_cp, (cp if layout.cp > 1 else None), own
