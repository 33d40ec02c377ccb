"""Pipeline parallelism (PP >= 2) for the dedup VLM step: where the encoder runs and who talks to whom.

NOTE [ Encoder under pipeline parallelism ]: the vision path lives in the first pipeline stage's
model chunk (megatron's ``pre_process`` chunk), so only that stage's ranks encode, serve cached
features and run the deferred encoder backward; later stages run megatron's schedule unchanged.
Encoding rows travel in the first stage's TP x DP x CP group (megatron's
``get_tensor_and_data_parallel_group(with_context_parallel=True)``), which at PP=1 is the world.
Every stage plans the same mini-batch (the planner is per (DP, CP) consumer, independent of the
stage) and must run the same number of micro-batches: a stage that runs fewer leaves its peers
waiting in a p2p send forever, so the counts are checked across the world first, with every other
check that can differ between ranks (NOTE [ Every rank refuses together ]).
The deferred backward runs inside the wrapped ``finalize_model_grads_func``, which every
pipeline schedule calls once after its last backward (cool-down included), so it runs after the
schedule's backward steps and before the first stage's gradient reduction, as at PP=1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from knitkit.encoder_dedup import Heard, tell_all
from knitkit.integration.megatron.device import collective_device


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """This rank's pipeline stage, read from megatron's ``parallel_state``."""

    size: int
    rank: int

    @classmethod
    def current(cls) -> PipelineStage:
        from megatron.core import parallel_state as ps

        return cls(
            ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        )

    @property
    def encodes(self) -> bool:
        """True on the first stage: the ranks that hold the vision path (see NOTE [ Encoder under pipeline parallelism ])."""
        return self.rank == 0


def stage_group() -> dist.ProcessGroup | None:
    """The ranks of this pipeline stage (TP x DP x CP); ``None`` (the world) at PP=1."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_and_data_parallel_group(with_context_parallel=True)


class StepRefused(ValueError):
    """A rank refused a step, or the ranks disagree on it; raised on every rank of the world alike."""


@dataclass(frozen=True, slots=True)
class StepFacts:
    """What every rank of a Megatron world must agree on before a step's first collective."""

    num_microbatches: int
    forward_only: bool = False
    plan: bytes = b""
    """The route's ``plan_fingerprint``: every stage and replica runs one mini-batch's plan."""
    problems: tuple[str, ...] = ()
    """This rank's local refusals (error texts); any rank's refusal stops every rank."""


# NOTE [ Every rank refuses together ]: under pipeline parallelism a rank that raises on its own
# before the schedule leaves the others blocked in a p2p send, a DDP reduction or the dedup
# handshake until the process group's timeout (30 minutes by default), and the error they finally
# get names nothing. So a step runs every check whose outcome can differ between ranks (its own
# inputs against its route, the model's configuration, the vision path's layout) WITHOUT raising,
# then all ranks of the world meet once (``agree_on_step``: one all-gather of fixed-width rows
# bounded by the step's timeout, see NOTE [ Handshake before rows move ] in
# knitkit/encoder_dedup/agreement.py) and compare what must be equal everywhere
# (num_microbatches, forward-only or not, the plan) and what each rank refused; every rank then raises the same ``StepRefused`` naming the ranks, their
# stages and what differs, or proceeds. A rank that never arrives gives a TimeoutError (the
# all-gather cannot tell which rank is late; the dedup handshakes that follow can).


def agree_on_step(facts: StepFacts, *, timeout_s: float) -> None:
    """Raise ``StepRefused`` on every rank unless all ranks agree and none refused (world, bounded).

    See NOTE [ Every rank refuses together ].
    """
    from megatron.core import parallel_state as ps

    plan = int.from_bytes(facts.plan[:8].ljust(8, b"\0"), "little", signed=True)
    stage = ps.get_pipeline_model_parallel_rank()
    values = (facts.num_microbatches, int(facts.forward_only), plan, stage)
    heard = tell_all(
        None,  # the world: every stage and replica of the step
        "step",
        values,
        "; ".join(facts.problems),
        device=collective_device(),
        timeout_s=timeout_s,
        hint="a rank did not start the step (every rank of the world runs DedupVLMStep.run each "
        "step) or is still in the previous one; raise handshake_timeout_s if ranks start steps "
        "further apart",
    )
    refused_step(dist.get_rank(), stage, heard)


def refused_step(me: int, stage: int, heard: list[Heard]) -> None:
    """Raise ``StepRefused`` if any rank refused or the ranks' step facts differ (``heard``: every
    rank's values ``num_microbatches, forward_only, plan, stage`` and refusal)."""
    lines = _verdict(heard)
    if lines:
        raise StepRefused(
            f"rank {me} (pipeline stage {stage}): the ranks refuse this step before "
            "its first collective (every rank raises this error). " + " ".join(lines)
        )


_MAX_LINES = 8
_FACTS: tuple[tuple[str, Callable[[int], str] | None, str], ...] = (
    ("num_microbatches", str, "every stage must run the same plan's plan.num_micro_batches"),
    ("forward_only", lambda v: str(bool(v)), "pass forward_only alike on every rank"),
    ("the plan (route fingerprints)", None, "build every rank's route from one mini-batch plan"),
)
"""What ``StepFacts`` values must be equal on every rank: name, how a value reads, what to do."""


def _verdict(heard: list[Heard]) -> list[str]:
    """What every rank says alike about what it heard: refusals by text, then differing facts."""
    refusals: dict[str, list[Heard]] = {}
    for h in heard:
        if h.problem:
            refusals.setdefault(h.problem, []).append(h)
    lines = [
        f"Ranks {[h.rank for h in hs]} (pipeline stages {sorted({h.values[3] for h in hs})}) "
        f"refuse: {problem}."
        for problem, hs in refusals.items()
    ][:_MAX_LINES]
    if len(refusals) > _MAX_LINES:
        lines.append(f"({len(refusals) - _MAX_LINES} more refusals.)")
    for index, (what, shown, hint) in enumerate(_FACTS):
        groups: dict[int, list[int]] = {}
        for h in heard:
            groups.setdefault(h.values[index], []).append(h.rank)
        if len(groups) == 1:
            continue
        spread = "; ".join(
            f"ranks {ranks}" if shown is None else f"{shown(value)} on ranks {ranks}"
            for value, ranks in groups.items()
        )
        if index == 0:
            spread = f"between {min(groups)} and {max(groups)}: {spread}"
        lines.append(f"Ranks disagree on {what} ({spread}); {hint}.")
    return lines


def check_microbatches_agree(num_microbatches: int, *, timeout_s: float = 600.0) -> None:
    """Raise ``StepRefused`` on every rank unless all ranks run ``num_microbatches`` (bounded).

    ``DedupVLMStep.run`` checks this and more itself (NOTE [ Every rank refuses together ]); this
    is for trainers that drive megatron's schedule without it. Every rank of the world calls it.
    """
    agree_on_step(StepFacts(num_microbatches), timeout_s=timeout_s)
