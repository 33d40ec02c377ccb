"""Real multi-process torch.distributed worlds for tests (the library's spawned worlds, re-exported).

Usage: ``from dist import World, run_world``; see ``knitkit.integration.megatron.testing.world``.
``lend`` hands a test module the suite's shared gloo world of a size (tests/conftest.py,
``gloo_world2``/``gloo_world4``) with every rank put back as a fresh world's (``as_fresh``).

NOTE [ One gloo world per size for the suite ]: a world's first job in a module paid for its
ranks' imports (megatron-core's models and schedules, knitkit's Megatron integration, the test
module; 2-7 s per world under load), and tests/encoder_dedup and the Megatron integration
modules started 16 worlds. They now borrow one world per size, kept until the last test that
uses it (tests/conftest.py closes it then). When a module returns a world, ``as_fresh`` puts
back what its jobs may have left on a rank: megatron-core's model-parallel state (and the two
groups its destroy keeps), every process group but the default one, the RNG tracker,
micro-batch calculator and router-replay registry, torch's global RNG, threads, grad mode,
default dtype and determinism, and the environment (the starting process's, as at spawn). A
gloo group keeps 3 threads that take CPU even idle (a world of 4: 0.1 s per 10 s fresh, 0.9 s
after one Megatron job's 20 groups, 3.5 s after five's), so a world must not wait idle holding
a module's groups (a shared world that did ran its next module's tests 10 s slower). Kept on
purpose: imported modules and the CPU shims of ``knitkit.integration.megatron.cpu``
(idempotent; each module installs the ones it uses). A job that raises tears the world down,
so the next one starts a fresh world. tests/test_dist.py checks that a rank dirtied in each
of these ways reads as a fresh one once its loan ends.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from knitkit.integration.megatron.testing.world import WorkerError, World, free_port, run_world

__all__ = ["WorkerError", "World", "as_fresh", "free_port", "lend", "rank_state", "run_world"]

_FRESH_RNG = torch.get_rng_state()
"""torch's global RNG state when this module is first imported. In a world's rank that is before
its first job runs (its jobs come from this module or from test modules that import it before
any code of theirs runs), so it is a fresh rank's: the fork server's, which ``manual_seed`` with
torch's default seed does not reproduce."""
_FRESH_THREADS = len(os.listdir("/proc/self/task"))
"""This process's threads at that point: a rank's own and its default group's."""


@contextlib.contextmanager
def lend(world: World, timeout_s: float) -> Iterator[World]:
    """``world`` for one module, ``timeout_s`` the default limit of each ``run`` while it is
    lent; its ranks put back as fresh (``as_fresh``) when it is returned, so a world never
    waits idle holding what a module left (leftover gloo groups' threads take CPU)."""
    kept = world.timeout_s
    world.timeout_s = timeout_s
    try:
        yield world
        world.run(as_fresh, dict(os.environ))
    finally:
        world.timeout_s = kept


def as_fresh(rank: int, environ: dict[str, str]) -> None:
    """Put this rank's process-global state back as a newly started rank has it (NOTE [ One
    gloo world per size for the suite ]); ``environ`` is the starting process's environment."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.set_rng_state(_FRESH_RNG)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(False)
    from megatron.core import num_microbatches_calculator, parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    parallel_state.destroy_model_parallel()
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):  # two that megatron-core 0.16.1's destroy keeps
            setattr(parallel_state, name, None)
    for group in [g for g in c10d._world.pg_map if g is not c10d._get_default_group()]:
        dist.destroy_process_group(group)  # a gloo group keeps 3 threads until it goes
    if len(os.listdir("/proc/self/task")) > _FRESH_THREADS:
        gc.collect()  # a group objects of earlier jobs still hold goes with them
        gc.freeze()  # what is left lives on: later collections skip it (0.4 s a rank each)
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    tp_random._CUDA_RNG_STATE_TRACKER = None
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    replay = sys.modules.get("megatron.core.transformer.moe.router_replay")
    if replay is not None:
        replay.RouterReplay.clear_global_router_replay_instances()


def rank_state(rank: int) -> dict[str, Any]:
    """What ``as_fresh`` puts back, as this rank has it now (for comparing with a fresh rank)."""
    from megatron.core import num_microbatches_calculator, parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    replay = sys.modules.get("megatron.core.transformer.moe.router_replay")
    return {
        "environ": dict(os.environ),
        "threads": torch.get_num_threads(),
        "rng": torch.get_rng_state().tolist(),
        "grad": torch.is_grad_enabled(),
        "dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "model_parallel": parallel_state.model_parallel_is_initialized(),
        "process_groups": len(c10d._world.pg_map),
        "threads_of_process": len(os.listdir("/proc/self/task")),
        "microbatches": num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None,
        "rng_tracker": tp_random._CUDA_RNG_STATE_TRACKER is not None,
        "router_replays": len(replay.RouterReplay.global_router_replay_instances) if replay else 0,
    }
