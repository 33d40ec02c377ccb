"""Gradient equivalence of ``DedupVLMStep`` against the unwrapped Megatron step, on the current layout."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from knitkit.encoder_dedup import EquivalenceReport, Tolerance
from knitkit.integration.megatron.testing.contract import check_contract
from knitkit.integration.megatron.testing.run import CheckRun
from knitkit.integration.megatron.testing.subject import Ref, VLMUnderTest, resolve
from knitkit.storage import PlannerConfig, Trajectory

Trajectories = Sequence[Trajectory] | Callable[[], Sequence[Trajectory]]
"""The mini-batch: trajectories with their multimodal inputs, or a function returning them."""
Optimizer = Callable[[list[torch.nn.Module]], Any]
"""Builds megatron's optimizer over one model's chunks (e.g. ``get_megatron_optimizer(config, chunks)``)."""


def check_equivalence(
    subject: VLMUnderTest,
    trajectories: Ref[Trajectories],
    *,
    rtol: float | None = None,
    floor: float | None = None,
    steps: int = 1,
    lr: float = 0.5,
    forward_only: bool = True,
    planner: PlannerConfig | None = None,
    optimizer: Ref[Optimizer] | None = None,
    seed: int = 1234,
) -> EquivalenceReport:
    """Run one mini-batch through the wrapped and the unwrapped model; every rank gets the merged report.

    Call it on every rank of an initialised ``parallel_state`` (the layout is read from it). The
    two models come from ``subject.provider`` with the same seed; both run ``trajectories``,
    planned by knitkit for this layout (``planner``; default: every per-token field, 3
    micro-batches per DP rank): the reference through ``get_forward_backward_func()``, the
    model's own forward running its real vision path on each micro-batch's images
    (``batch["images"]``, NOTE [ Re-encoding reference ], or ``subject.reference_batches``), the
    wrap through ``DedupVLMStep.run`` with ``subject.encoder``. Compared: per
    parameter, its gradient after ``finalize_model_grads`` (``main_grad``; this rank's shard
    under the distributed optimizer); per key, the loss dicts of the training pass and of a
    forward-only pass (``forward_only``); the units encoded (each unique unit once, with every
    TP peer for a TP-sharded vision path). ``steps > 1`` repeats the mini-batch after updating
    both models (plain SGD with ``lr`` on ``main_grad``, or ``optimizer``'s step, after which
    the parameters are compared too), so DDP's first- and later-batch paths both run.

    ``rtol`` and ``floor`` (NOTE [ Floor of a relative comparison ]) default to
    ``Tolerance.for_dtype(config.params_dtype)``: fp32 ``1e-4`` and ``1e-6``, bf16 ``3e-2`` and
    ``1e-3``.
    """
    if steps < 1:
        raise ValueError(f"steps={steps}; the check runs at least one mini-batch")
    run = CheckRun.build(subject, check_contract(subject, trajectories), planner, seed)
    default = Tolerance.for_dtype(run.config.params_dtype)
    tol = Tolerance(
        default.rtol if rtol is None else rtol, default.floor if floor is None else floor
    )
    make = resolve(optimizer) if optimizer is not None else None
    optimizers = [make(model) for model in (run.reference, run.wrapped)] if make else []
    reports: list[EquivalenceReport] = []
    try:
        for step in range(steps):
            reports.append(run.training_pass(tol))
            if run.stopped:  # the wrap cannot run as declared: said in run.problems
                forward_only = False
                break
            if optimizers:
                reports.append(run.optimizer_step(optimizers, tol))
            elif step < steps - 1:
                run.sgd(lr)
        if forward_only:
            reports.append(run.forward_only_pass(tol))
    except Exception as error:
        forward_only = False  # it did not finish: its unit count means nothing
        # A broken wrap often trips megatron itself in a later pass (e.g. DDP's bucket check
        # when a parameter never got a gradient): keep the rows compared so far and say where.
        if not reports:
            raise
        where = traceback.extract_tb(error.__traceback__)[-1]
        run.problems.append(
            f"the check stopped after {len(reports)} pass(es): {type(error).__name__}: {error} "
            f"({Path(where.filename).name}:{where.lineno} in {where.name})"
        )
    run.check_restored()
    return _gathered(run, EquivalenceReport.merged(reports), steps, forward_only)


def _gathered(
    run: CheckRun, here: EquivalenceReport, steps: int, forward_only: bool
) -> EquivalenceReport:
    """This rank's rows merged with every other rank's (the same report on every rank)."""
    from megatron.core import parallel_state as ps

    mine = (
        here,
        run.encoded,
        run.reencoded,
        tuple(run.problems),
        run.encoded_forward_only,
        run.stopped,
    )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged = EquivalenceReport.merged([g[0] for g in gathered])
    topology, pp = run.layout.topology, ps.get_pipeline_model_parallel_world_size()
    layout = f"DP{topology.dp} x CP{topology.cp} x TP{topology.tp}" + (
        f" x PP{pp}" if pp > 1 else ""
    )
    dtype = str(run.config.params_dtype).removeprefix("torch.")
    first = run.prefix(0, stage=0)
    per_pass = run.unique_units * (topology.tp if run.subject.tp_sharded_vision else 1)
    stopped = any(g[5] for g in gathered)
    problems = [p for g in gathered for p in g[3]]
    encoded_forward_only = sum(g[4] for g in gathered)
    if forward_only and encoded_forward_only != per_pass:
        problems.append(
            f"the forward-only pass encoded {encoded_forward_only} units, expected {per_pass}"
        )
    return EquivalenceReport(
        title=f"DedupVLMStep vs the unwrapped step: {layout}, {dtype}, {steps} mini-batch(es)",
        tolerance=merged.tolerance,
        gradients=merged.gradients,
        outputs=merged.outputs,
        encoder_prefixes=tuple(
            f"{first}{path}." for path in (run.subject.vision, *run.subject.vision_extra)
        ),
        units_with_dedup=sum(g[1] for g in gathered),
        units_without_dedup=sum(g[2] for g in gathered),
        expected_units=None if stopped else per_pass * steps,
        extra_problems=tuple(dict.fromkeys(problems)),
    )
