"""Per-rank equivalence run of a toy Case through ``check_dedup_equivalence`` (test helper)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from encoder_dedup.toy import Case, ItemView, ToyBackbone, ToyEncoder, item_view, unit_inputs
from knitkit.encoder_dedup import (
    BackboneAssignment,
    EncoderAssignment,
    LocalTransport,
    ProcessGroupTransport,
    RoutingPlan,
    build_routing_plan,
    sync_encoder_grads,
)
from knitkit.encoder_dedup.testing import check_dedup_equivalence
from knitkit.integration.megatron import cpu as megatron_cpu
from knitkit.types import UnitKey

Report = dict[str, tuple[float, float]]
"""Parameter name -> (max |dedup - baseline|, max |baseline|), from ``EquivalenceReport``'s rows."""


def assignments_for(case: Case) -> tuple[EncoderAssignment, BackboneAssignment]:
    """The encoder's round-robin partition over its ranks and the backbone's rows per (DP, CP, TP)."""
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
    return encoder, backbone


def plan_for(case: Case) -> RoutingPlan:
    """The dedup routing plan of a case: encoder round-robin over its ranks, backbone per (DP, CP, TP)."""
    return build_routing_plan(*assignments_for(case), case.layout.world)


def run_case(rank: int, case: Case) -> tuple[Report, int, int]:
    """Gradients of baseline and dedup on this rank through ``check_dedup_equivalence``;
    returns (report, baseline encodes, dedup encodes) of this rank."""
    layout = case.layout
    torch.manual_seed(0)
    dp_cp_group, cp_group, own = _groups(rank, case) if layout.world > 1 else (None, None, [])
    if layout.megatron:
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

        def finalize() -> None:
            _reduce(backbone.parameters(), dp_cp_group)
            sync_encoder_grads(encoder.parameters())

        report = check_dedup_equivalence(
            encoder,
            backbone,
            encode_fn=lambda keys: encoder([units[k] for k in keys]),
            backbone_step=lambda i, feats: backbone(views[i], feats, cp_group, norm),
            assignment=assignments_for(case),
            hidden=encoder.projector.out_features,
            transport=ProcessGroupTransport() if layout.world > 1 else LocalTransport(),
            reduce_reference=lambda: _reduce(
                [*encoder.parameters(), *backbone.parameters()], dp_cp_group
            ),
            reduce_dedup=finalize,
            dtype=dtype,
            device=case.device,
            gather=False,
        )
        rows = {c.name: (c.max_abs_diff, c.max_abs_ref) for c in report.gradients}
        return rows, report.units_without_dedup, report.units_with_dedup
    finally:
        if layout.megatron:
            megatron_cpu.destroy_model_parallel()
        for group in own:
            dist.destroy_process_group(group)


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


@dataclass(slots=True)
class WatchedTransport:
    """A rank's real transport that calls ``before(rows)`` ahead of each exchange: ``rows`` is
    True for feature rows (floating point), False for a handshake's int64 rows. Tests override
    ``before`` to count exchanges or to fail one."""

    inner: ProcessGroupTransport

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def before(self, rows: bool) -> None:
        """Runs ahead of each exchange; nothing here."""

    def exchange(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        *,
        timeout_s: float | None = None,
    ) -> torch.Tensor:
        self.before(send.is_floating_point())
        return self.inner.exchange(send, send_counts, recv_counts, timeout_s=timeout_s)


@contextmanager
def pool_idioms() -> Iterator[list[str]]:
    """Records each call, on this thread, of the two idioms that enter torch's intra-op pool on
    few-element tensors (NOTE [ Segment ids off the intra-op pool ]): ``repeat_interleave`` and a
    gather by an integer tensor index, ``x[ids]``. A torch function mode, not patched methods:
    a ``Tensor.__getitem__`` set on the class, even set back, leaves the type a sequence for
    the rest of the process (``torch.tensor`` of 0-d tensors then raises)."""
    calls: list[str] = []
    with _PoolIdioms(calls):
        yield calls


class _PoolIdioms(TorchFunctionMode):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            self.calls.append("repeat_interleave")
        elif func is torch.Tensor.__getitem__ and len(args) > 1:
            keys = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(
                isinstance(k, torch.Tensor) and not k.is_floating_point() and k.dtype != torch.bool
                for k in keys
            ):
                self.calls.append("__getitem__")
        return func(*args, **(kwargs or {}))
