"""Gradient-equivalence checks: dedup against the re-encoding baseline, as a report users assert in their tests."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from knitkit.encoder_dedup.assignment import BackboneAssignment, EncoderAssignment
from knitkit.encoder_dedup.dedup import DedupEncoder, EncodeFn
from knitkit.encoder_dedup.grad_sync import sync_encoder_grads
from knitkit.encoder_dedup.minibatch import BackboneStep, train_minibatch
from knitkit.encoder_dedup.plan import build_routing_plan
from knitkit.encoder_dedup.transport import LocalTransport, RowTransport

Status = Literal["ok", "below_floor", "mismatch", "missing"]
FAILING: tuple[Status, ...] = ("mismatch", "missing")


@dataclass(frozen=True, slots=True)
class Tolerance:
    """Two tensors agree when ``max|a - a_ref| <= rtol * max(max|a_ref|, floor)``.

    NOTE [ Floor of a relative comparison ]: a relative error means something only where the
    reference is not ~0. A tensor whose reference is below ``floor`` is therefore not compared
    relatively: it is reported as ``below_floor`` (listed by name in the report, never silently
    passed) and still fails if it differs by more than ``rtol * floor``. A check in which most
    encoder parameters (more than half, or all) have a reference gradient below the floor fails
    outright: it cannot tell a detached encoder, or a detached trunk under a live projector, from
    a working one.
    """

    rtol: float
    """Largest relative error ``max|a - a_ref| / max|a_ref|``."""
    floor: float
    """Smallest ``max|a_ref|`` compared relatively."""

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> Tolerance:
        """The defaults: fp32 and fp64 ``rtol=1e-4, floor=1e-6`` (dedup only reorders sums,
        measured worst ~1e-6 on knitkit's models); bf16 and fp16 ``rtol=3e-2, floor=1e-3``
        (the baseline accumulates parameter gradients per micro-batch in the low precision,
        dedup sums feature gradients in fp32)."""
        if dtype in (torch.bfloat16, torch.float16):
            return cls(rtol=3e-2, floor=1e-3)
        return cls(rtol=1e-4, floor=1e-6)


@dataclass(frozen=True, slots=True)
class Comparison:
    """One parameter's gradient (or one output) with dedup against the baseline, on one rank."""

    name: str
    max_abs_diff: float
    """``max|a - a_ref|`` (inf when one side is missing or shapes differ)."""
    max_abs_ref: float
    """``max|a_ref|``."""
    rank: int
    """The global rank holding it (the worst one, once ranks are merged)."""
    status: Status

    @classmethod
    def of(
        cls,
        name: str,
        got: torch.Tensor | None,
        ref: torch.Tensor | None,
        rank: int,
        tolerance: Tolerance,
    ) -> Comparison:
        """Compare ``got`` to ``ref`` (see NOTE [ Floor of a relative comparison ]); ``None``
        is a zero gradient (a parameter autograd never reached)."""
        if got is None and ref is not None:
            got = torch.zeros_like(ref)
        if ref is None and got is not None:
            ref = torch.zeros_like(got)
        if got is None or ref is None:
            return cls(name, 0.0, 0.0, rank, "below_floor")
        if got.shape != ref.shape:
            scale = float(ref.abs().max()) if ref is not None and ref.numel() else 0.0
            return cls(name, math.inf, scale, rank, "missing")
        if ref.numel() == 0:
            return cls(name, 0.0, 0.0, rank, "below_floor")
        wide = torch.promote_types(ref.dtype, torch.float32)
        diff = float((got.to(wide) - ref.to(wide)).abs().max())
        scale = float(ref.abs().max())
        if not (math.isfinite(diff) and math.isfinite(scale)):
            return cls(name, diff, scale, rank, "mismatch")
        if diff > tolerance.rtol * max(scale, tolerance.floor):
            return cls(name, diff, scale, rank, "mismatch")
        return cls(name, diff, scale, rank, "ok" if scale >= tolerance.floor else "below_floor")

    @property
    def relative_error(self) -> float:
        if self.max_abs_ref > 0:
            return self.max_abs_diff / self.max_abs_ref
        return 0.0 if self.max_abs_diff == 0 else math.inf

    @property
    def failed(self) -> bool:
        return self.status in FAILING


@dataclass(frozen=True, slots=True)
class EquivalenceReport:
    """Gradients and outputs with dedup against the baseline, merged over ranks; render, assert or save.

    ``ok`` holds when no row mismatches or is missing, at least half the encoder parameters are
    compared above the floor, and dedup encoded exactly the expected units; ``raise_if_failed``
    names what did not.
    """

    title: str
    """What was checked (model, layout, dtype)."""
    tolerance: Tolerance
    gradients: tuple[Comparison, ...]
    """One row per parameter (its worst rank)."""
    outputs: tuple[Comparison, ...] = ()
    """Losses and log-probs per output key and pass, e.g. ``train[lm loss]``, ``forward_only[logprobs]``."""
    encoder_prefixes: tuple[str, ...] = ("encoder.",)
    """Parameter names starting with one of these belong to the encoder (vision path)."""
    units_with_dedup: int = 0
    """Unit encodings with dedup, summed over the world."""
    units_without_dedup: int = 0
    """Unit encodings of the baseline (every micro-batch re-encodes what it consumes)."""
    expected_units: int | None = None
    """What dedup must encode (each unique unit once; times TP for a TP-sharded encoder)."""
    extra_problems: tuple[str, ...] = field(default=())
    """Problems found outside the rows (e.g. a vision path not restored)."""

    @classmethod
    def merged(
        cls, reports: Sequence[EquivalenceReport], *, title: str | None = None
    ) -> EquivalenceReport:
        """One report from every rank's: per row name its worst rank, unit counts summed."""
        first = reports[0]
        return cls(
            title=first.title if title is None else title,
            tolerance=first.tolerance,
            gradients=_worst_per_name(r.gradients for r in reports),
            outputs=_worst_per_name(r.outputs for r in reports),
            encoder_prefixes=first.encoder_prefixes,
            units_with_dedup=sum(r.units_with_dedup for r in reports),
            units_without_dedup=sum(r.units_without_dedup for r in reports),
            expected_units=first.expected_units,
            extra_problems=tuple(dict.fromkeys(p for r in reports for p in r.extra_problems)),
        )

    @property
    def failures(self) -> tuple[Comparison, ...]:
        return tuple(c for c in (*self.gradients, *self.outputs) if c.failed)

    @property
    def below_floor(self) -> tuple[str, ...]:
        """Names compared only absolutely (reference below the floor)."""
        return tuple(c.name for c in (*self.gradients, *self.outputs) if c.status == "below_floor")

    @property
    def worst_relative_error(self) -> float:
        """Worst relative gradient error among parameters above the floor (0 if none)."""
        return max((c.relative_error for c in self.gradients if c.status == "ok"), default=0.0)

    @property
    def problems(self) -> tuple[str, ...]:
        """Why the check cannot vouch for the wrap, beyond failing rows."""
        problems = list(self.extra_problems)
        encoder = [c for c in self.gradients if c.name.startswith(self.encoder_prefixes)]
        if not self.gradients:
            problems.append("no parameter gradient was compared")
        elif 2 * sum(c.status == "below_floor" for c in encoder) > len(encoder) or not encoder:
            below = [c.name for c in encoder if c.status == "below_floor"]
            problems.append(
                f"{len(below)} of {len(encoder)} encoder parameters "
                f"({', '.join(self.encoder_prefixes)}) have a reference gradient below the floor "
                f"{self.tolerance.floor:g} ({', '.join(below[:4])}{', ...' if len(below) > 4 else ''})"
                ": the check cannot tell a detached encoder from a working one; use a mini-batch "
                "with multimodal inputs whose features reach the loss, and a reference whose "
                "vision path is the model's own"
            )
        if self.expected_units is not None and self.units_with_dedup != self.expected_units:
            problems.append(
                f"dedup encoded {self.units_with_dedup} units, expected {self.expected_units}"
            )
        return tuple(problems)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.problems

    def raise_if_failed(self, *, expect_below_floor: Iterable[str] | None = None) -> None:
        """Raise ``EquivalenceError`` naming every failing parameter and output, with the table.

        ``expect_below_floor`` states which names may have a reference below the floor (e.g.
        ``()``: every parameter must be compared relatively); any other set fails too.
        """
        lines = []
        if expect_below_floor is not None:
            unexpected = set(self.below_floor) ^ set(expect_below_floor)
            if unexpected:
                lines.append(
                    f"below the floor: {sorted(self.below_floor)}, stated: "
                    f"{sorted(expect_below_floor)}"
                )
        if self.ok and not lines:
            return
        names = [c.name for c in self.failures]
        if names:
            lines.append(f"failing ({len(names)}): {', '.join(names)}")
        lines += [f"problem: {p}" for p in self.problems]
        raise EquivalenceError(
            "\n".join([f"{self.title}: NOT equivalent", *lines, "", self.table()])
        )

    def table(self) -> str:
        """A plain-text table: one row per parameter and output, then counts and the verdict."""
        width = max((len(c.name) for c in (*self.gradients, *self.outputs)), default=10)
        tol = self.tolerance
        head = f"{'':{width}}  {'max|d|':>9}  {'max|ref|':>9}  {'rel err':>9}  rank  status"
        lines = [
            self.title,
            f"tolerance: max|a - a_ref| <= {tol.rtol:g} * max(max|a_ref|, {tol.floor:g})",
        ]
        for label, rows in (("gradients", self.gradients), ("outputs", self.outputs)):
            if rows:
                lines += [f"{label}:", head.replace(" " * width, "name".ljust(width), 1)]
                lines += [_row(c, width) for c in rows]
        lines.append(
            f"units encoded: {self.units_with_dedup} with dedup, {self.units_without_dedup} "
            f"without"
            + ("" if self.expected_units is None else f" (expected {self.expected_units})")
        )
        if self.below_floor:
            lines.append(
                f"below the floor (compared absolutely only): {', '.join(self.below_floor)}"
            )
        lines.append(f"worst relative gradient error: {self.worst_relative_error:.2e}")
        lines += [f"problem: {p}" for p in self.problems]
        lines.append("PASS" if self.ok else f"FAIL ({len(self.failures)} failing rows)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict: every row with its relative error, the verdict and the problems."""
        data = asdict(self)
        for key in ("gradients", "outputs"):
            for row, comparison in zip(data[key], getattr(self, key), strict=True):
                row["relative_error"] = _finite(comparison.relative_error)
                row["max_abs_diff"] = _finite(comparison.max_abs_diff)
        data.update(
            ok=self.ok,
            problems=list(self.problems),
            below_floor=list(self.below_floor),
            worst_relative_error=self.worst_relative_error,
        )
        return data

    def dumps(self) -> str:
        """``to_json`` as indented JSON text."""
        return json.dumps(self.to_json(), indent=2)


class EquivalenceError(AssertionError):
    """A gradient-equivalence check failed; the message names the parameters and holds the table."""


def check_dedup_equivalence(
    encoder: torch.nn.Module,
    backbone: torch.nn.Module,
    *,
    encode_fn: EncodeFn,
    backbone_step: BackboneStep,
    assignment: tuple[EncoderAssignment, BackboneAssignment],
    hidden: int,
    transport: RowTransport | None = None,
    reduce_reference: Callable[[], None] | None = None,
    reduce_dedup: Callable[[], None] | None = None,
    tolerance: Tolerance | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    gather: bool = True,
) -> EquivalenceReport:
    """One mini-batch through the re-encoding baseline and through ``DedupEncoder``; compare gradients.

    The baseline is the plain loop: backbone micro-batch ``i`` re-encodes every row slice it
    consumes (``assignment``'s backbone side, this rank's ``transport.rank``) with ``encode_fn``,
    then ``backbone_step(i, features).backward()``; then ``reduce_reference()``. The dedup run is
    ``train_minibatch`` with ``finalize=reduce_dedup``. Gradients start from zero in both.
    Reductions default to the data-parallel trainer: the baseline SUM-all-reduces every gradient
    over the transport's group, dedup SUM-all-reduces the backbone's and ``sync_encoder_grads`` the
    encoder's (nothing on one rank). Pass your trainer's own for TP or CP layouts.

    Every rank of the transport calls it; with ``gather`` every rank gets the merged report.
    """
    transport = transport or LocalTransport()
    group = getattr(transport, "group", None)
    rank, world = transport.rank, transport.world_size
    encoders, backbones = assignment
    named = [(f"encoder.{n}", p) for n, p in encoder.named_parameters() if p.requires_grad] + [
        (f"backbone.{n}", p) for n, p in backbone.named_parameters() if p.requires_grad
    ]
    params = [p for _, p in named]
    if world > 1:
        reduce_reference = reduce_reference or (lambda: _all_reduce(params, group))

        def _reduce_dedup() -> None:
            _all_reduce(backbone.parameters(), group)
            sync_encoder_grads(encoder.parameters(), group)

        reduce_dedup = reduce_dedup or _reduce_dedup
    for p in params:
        p.grad = None
    reference_encodes = 0
    for i, slices in enumerate(backbones.micro_batches.get(rank, ())):
        rows = [encode_fn([s.key])[s.start : s.stop] for s in slices]
        reference_encodes += len(rows)
        features = torch.cat(rows) if rows else torch.zeros(0, hidden, dtype=dtype, device=device)
        backbone_step(i, features).backward()
    if reduce_reference is not None:
        reduce_reference()
    reference = {name: None if p.grad is None else p.grad.clone() for name, p in named}
    for p in params:
        p.grad = None
    route = build_routing_plan(encoders, backbones, world).for_rank(rank)
    dedup = DedupEncoder(route, transport, hidden=hidden, dtype=dtype, device=device)
    train_minibatch(dedup, encode_fn, backbone_step, finalize=reduce_dedup)
    tol = tolerance or Tolerance.for_dtype(dtype)
    here = EquivalenceReport(
        title=f"encoder dedup vs re-encoding baseline, {world} rank(s), {str(dtype).split('.')[-1]}",
        tolerance=tol,
        gradients=tuple(
            Comparison.of(name, p.grad, reference[name], _global_rank(), tol) for name, p in named
        ),
        units_with_dedup=dedup.encoded_units,
        units_without_dedup=reference_encodes,
        expected_units=sum(len(mb) for mbs in encoders.micro_batches.values() for mb in mbs),
    )
    if not gather or world == 1:
        return here
    reports: list[EquivalenceReport | None] = [None] * world
    dist.all_gather_object(reports, here, group=group)
    return EquivalenceReport.merged([r for r in reports if r is not None])


def _all_reduce(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None) -> None:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _worst_per_name(rows_per_rank: Iterable[Iterable[Comparison]]) -> tuple[Comparison, ...]:
    """Per name, the row that is furthest beyond (or closest to) its tolerance; first-seen order."""
    worst: dict[str, Comparison] = {}
    for rows in rows_per_rank:
        for row in rows:
            seen = worst.get(row.name)
            if seen is None or _severity(row) > _severity(seen):
                worst[row.name] = row
    return tuple(worst.values())


def _severity(row: Comparison) -> tuple[bool, bool, float]:
    return (row.failed, row.status == "ok", row.relative_error)


def _row(c: Comparison, width: int) -> str:
    rel = f"{c.relative_error:9.2e}" if c.status != "below_floor" else f"{'(floor)':>9}"
    return (
        f"{c.name:{width}}  {c.max_abs_diff:9.2e}  {c.max_abs_ref:9.2e}  {rel}  "
        f"{c.rank:4d}  {c.status}"
    )


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
