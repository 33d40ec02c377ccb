"""One equivalence check as plain data, run on every rank of a spawned world or under torchrun."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch.distributed as dist

from knitkit.encoder_dedup import EquivalenceReport
from knitkit.integration.megatron.testing.subject import VLMUnderTest, import_path


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckJob:
    """What to check (every user object by import path, so ranks import it themselves) and on which layout.

    The data-parallel size is what the world leaves: ``world_size / (tp * pp * cp)``.
    """

    subject: VLMUnderTest
    trajectories: str
    """Import path of the trajectories (a list, or a function returning one)."""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    rtol: float | None = None
    floor: float | None = None
    """Tolerance overrides; the rest from ``Tolerance.for_dtype`` of the model's ``params_dtype``."""
    steps: int = 1
    forward_only: bool = True
    python_path: tuple[str, ...] = ()
    """Folders each rank puts first on ``sys.path`` before importing the user's objects."""

    @classmethod
    def of(cls, subject: VLMUnderTest, trajectories: object, **layout: object) -> CheckJob:
        """A job whose callables are replaced by their import paths (module-level objects only)."""
        named = {
            f.name: import_path(value)
            for f in dataclasses.fields(subject)
            if callable(value := getattr(subject, f.name)) and not isinstance(value, str)
        }
        paths = trajectories if isinstance(trajectories, str) else import_path(trajectories)
        return cls(subject=dataclasses.replace(subject, **named), trajectories=paths, **layout)  # type: ignore[arg-type]

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel


def run_job(rank: int, job: CheckJob) -> EquivalenceReport:
    """Set up ``parallel_state`` for ``job`` on this rank's initialised world, check, tear down.

    On a machine without CUDA the layers and schedules run through ``knitkit.integration.megatron.cpu``
    (gloo); with CUDA that module patches nothing and megatron runs as in production (NCCL).
    """
    from knitkit.integration.megatron import cpu
    from knitkit.integration.megatron.testing.check import check_equivalence

    world = dist.get_world_size()
    if world % job.model_parallel:
        raise ValueError(
            f"a world of {world} ranks cannot hold TP{job.tensor_parallel} x PP"
            f"{job.pipeline_parallel} x CP{job.context_parallel}; use a multiple of {job.model_parallel}"
        )
    for folder in reversed(job.python_path):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    cpu.initialize_model_parallel(
        tensor_parallel=job.tensor_parallel,
        context_parallel=job.context_parallel,
        pipeline_parallel=job.pipeline_parallel,
    )
    cpu.install_pipeline_shim()
    cpu.install_vision_shim()
    try:
        return check_equivalence(
            job.subject,
            job.trajectories,
            rtol=job.rtol,
            floor=job.floor,
            steps=job.steps,
            forward_only=job.forward_only,
        )
    finally:
        cpu.destroy_model_parallel()
