"""The knitkit loop against the plain loop: per-step figures and gradients, every parameter, stated fp32 tolerances."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from grpo.train import StepRecord

COMPARED = ("loss", "pg", "kl", "nll", "reward", "clipped")
"""Per-step figures compared (summed over the world)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerance:
    """``|x - ref| <= atol`` everywhere, and ``|x - ref| <= rtol * |ref|`` where ``|ref| >= floor``."""

    rtol: float
    atol: float
    floor: float


FIGURES = Tolerance(rtol=1e-3, atol=1e-6, floor=1e-4)
"""Per-step figures: sums over the mini-batch in another order (other micro-batches, packing).
The policy-gradient sum cancels to about 0 at ratio 1 (advantages have mean 0 per group), so
a figure's error is set by its terms (about 1), not by its value: up to 6e-5 of the loss."""
GRADIENTS = Tolerance(rtol=1e-3, atol=1e-6, floor=1e-5)
"""Each step's reduced gradients (``main_grad``), every element; the largest are about 0.3."""
PARAMETERS = Tolerance(rtol=1e-2, atol=1e-5, floor=1e-4)
"""Parameters after the last step, ``ref`` = the plain loop's update (final minus initial).

NOTE [ Adam and the equivalence check ]: Adam divides each element's first moment by the root of
its second, so fp32 reordering differences of a gradient element (1e-7 relative) grow where
successive gradients cancel in the first moment: measured up to 3e-3 of the update after 3 steps
(up to 4e-5 with plain SGD on the same data). Adam is also blind to a wrong gradient SCALE (a
factor 2 from a double-counted TP replica moves every parameter the same). So the check holds
the gradients of every step element-wise, tightly, and the parameters after the last step at a
looser relative tolerance of their update.
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One kind of value compared: its worst differences over the world and the verdict."""

    tolerance: Tolerance
    max_abs: float
    max_rel: float
    """Over the values whose reference is above the floor."""
    checked: int
    """Values compared relatively (summed over the world)."""
    reference_max: float
    """Largest ``|ref|``: the scale the differences are measured against."""
    ok: bool

    @classmethod
    def of(cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], tolerance: Tolerance) -> Check:
        """Compare ``(value, reference)`` pairs on every rank (a collective, reduced over the world)."""
        max_abs = max_rel = reference_max = 0.0
        checked, ok = 0, True
        for value, reference in pairs:
            diff = (value.double() - reference.double()).abs()
            size = reference.double().abs()
            above = size >= tolerance.floor
            if diff.numel():
                max_abs = max(max_abs, float(diff.max()))
                reference_max = max(reference_max, float(size.max()))
            if bool(above.any()):
                max_rel = max(max_rel, float((diff[above] / size[above]).max()))
            checked += int(above.sum())
            ok &= bool((diff <= tolerance.atol).all())
            ok &= bool((diff[above] <= tolerance.rtol * size[above]).all())
        worst = torch.tensor([max_abs, max_rel, reference_max, float(not ok)], dtype=torch.float64)
        count = torch.tensor([float(checked)], dtype=torch.float64)
        if dist.is_initialized():
            worst, count = _world(worst, dist.ReduceOp.MAX), _world(count, dist.ReduceOp.SUM)
        return cls(
            tolerance=tolerance,
            max_abs=float(worst[0]),
            max_rel=float(worst[1]),
            checked=int(count[0]),
            reference_max=float(worst[2]),
            ok=not bool(worst[3]) and int(count[0]) > 0,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """The two loops compared: same trajectories per step, then figures, gradients, parameters."""

    same_trajectories: bool
    figures: Check
    gradients: Check
    parameters: Check

    @property
    def ok(self) -> bool:
        return (
            self.same_trajectories and self.figures.ok and self.gradients.ok and self.parameters.ok
        )

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "ok": self.ok}


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """A copy of this rank's parameters (its TP shards), in ``parameters()`` order."""
    return [p.detach().clone() for p in model.parameters()]


def compare(
    knit: Sequence[StepRecord],
    plain: Sequence[StepRecord],
    gradients: tuple[Sequence[Sequence[torch.Tensor]], Sequence[Sequence[torch.Tensor]]],
    initial: Sequence[torch.Tensor],
    params: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
) -> Comparison:
    """Compare the knitkit loop with the plain loop (a collective: call it on every rank).

    ``gradients`` and ``params`` are (knitkit, plain) pairs from the two ``Trainer``s; the
    parameters are compared as updates from ``initial`` (both loops start from the same weights);
    why gradients too, see NOTE [ Adam and the equivalence check ].
    """
    same = [r.trajectory_ids for r in knit] == [r.trajectory_ids for r in plain]
    figures = [
        (torch.tensor(mine.figures[name]), torch.tensor(ref.figures[name]))
        for mine, ref in zip(knit, plain, strict=True)
        for name in COMPARED
    ]
    grads = [
        pair for mine, ref in zip(*gradients, strict=True) for pair in zip(mine, ref, strict=True)
    ]
    updates = [(mine - p0, ref - p0) for p0, mine, ref in zip(initial, *params, strict=True)]
    return Comparison(
        same_trajectories=same,
        figures=Check.of(figures, FIGURES),
        gradients=Check.of(grads, GRADIENTS),
        parameters=Check.of(updates, PARAMETERS),
    )


def _world(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    from knitkit.integration.megatron import current_device

    tensor = tensor.to(current_device())
    dist.all_reduce(tensor, op=op)
    return tensor.cpu()
