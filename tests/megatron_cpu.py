"""Test-only shim: run megatron-core 0.16.1 parallel state and tensor-parallel layers on CPU with gloo.

megatron-core assumes CUDA in a few places (``torch.cuda.current_device()`` as an allocation device,
the CUDA RNG tracker). This module patches exactly those, process-locally, so that real
``parallel_state`` groups and real ``ColumnParallelLinear`` / ``RowParallelLinear`` layers run in a
spawned gloo world (see ``tests/dist.py``). It is imported by tests only; ``knitkit/`` never imports
megatron. Extend it by ADDING functions (e.g. schedule or DDP shims), one documented job each.

Usage inside a rank of a ``tests.dist.World``::

    import megatron_cpu
    megatron_cpu.initialize_model_parallel(tensor_parallel=2, context_parallel=1)
    layer = ColumnParallelLinear(8, 16, config=megatron_cpu.model_parallel_config(), ...)
    ...
    megatron_cpu.destroy_model_parallel()

Facts this relies on are in ``/work/shared/notes/megatron.md`` section 2 (tested on 0.16.1).
"""

from __future__ import annotations

import torch

_installed = False


def install() -> None:
    """Patch the CUDA assumptions megatron-core makes on the allocation path (idempotent).

    ``torch.cuda.current_device`` returns ``"cpu"`` so ``torch.empty(..., device=current_device())``
    allocates on the CPU (megatron's mappings and layers use it for gather buffers).
    On a machine with CUDA nothing is patched: megatron-core then runs as it does in production.
    """
    global _installed
    if _installed or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    _installed = True


def initialize_model_parallel(
    tensor_parallel: int = 1, context_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0
) -> None:
    """``parallel_state.initialize_model_parallel`` on the current gloo world, plus a CPU RNG tracker.

    Any earlier model-parallel state is destroyed first, so one spawned world can host many layouts.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    install()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        context_parallel_size=context_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
    )
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tp_random.model_parallel_cuda_manual_seed(seed)
    else:
        # NOTE: the CUDA RNG tracker cannot seed on CPU; the inference tracker's fork() is a
        # no-op, which is all TP layers need when initialised on CPU from torch's global seed.
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def destroy_model_parallel() -> None:
    """Tear down the groups made by ``initialize_model_parallel``."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def model_parallel_config(**overrides: object) -> object:
    """A ``ModelParallelConfig`` matching the current parallel state, initialised on the CPU."""
    from megatron.core import ModelParallelConfig, parallel_state

    kwargs: dict[str, object] = {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "use_cpu_initialization": True,
        "perform_initialization": True,
    }
    kwargs.update(overrides)
    return ModelParallelConfig(**kwargs)


class _SchedulesTorch:
    """Stands in for ``torch`` inside megatron's ``schedules.py``: ``zeros(device="cuda")`` lands on the CPU."""

    def __getattr__(self, name: str) -> object:
        if name == "zeros":
            return _zeros_on_cpu
        return getattr(torch, name)


def _zeros_on_cpu(*args: object, **kwargs: object) -> torch.Tensor:
    kwargs["device"] = "cpu"
    return torch.zeros(*args, **kwargs)  # type: ignore[call-overload,no-any-return]


def install_schedule_shim() -> None:
    """Let ``get_forward_backward_func()`` schedules and Megatron DDP run on CPU (idempotent).

    On top of ``install()``: the no-pipelining schedule allocates its token counter with
    ``torch.zeros(..., device="cuda")`` (schedules.py L596 in 0.16.1); only that module's
    ``torch`` is proxied, so nothing else changes. DDP's grad buffers use
    ``torch.cuda.current_device()`` and are covered by ``install()``. Call it after
    ``initialize_model_parallel`` (which sets up the CPU RNG tracker). No-op with CUDA.
    """
    install()
    if torch.cuda.is_available():
        return
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _SchedulesTorch):
        schedules.torch = _SchedulesTorch()  # type: ignore[assignment]
