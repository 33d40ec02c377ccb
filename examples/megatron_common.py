"""What the Megatron examples share: the launch under torchrun, knitkit's training loop, the loss.

Each example (``megatron_wrap.py``, ``megatron_llava.py``, ``megatron_mrope.py``) keeps its own
model, data and forward step, and what it plans and batches; this module runs the rest. Not an
example by itself: it is imported by the examples (their folder is on ``sys.path`` when one runs as
a script) and by the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist

from knitkit.integration.megatron import (
    DedupVLMStep,
    MegatronLayout,
    current_device,
    megatron_batches,
)
from knitkit.metrics import FanOut, MetricsObserver, TensorBoardObserver, merge
from knitkit.microbatch_iter import MicroBatch, MicroBatchIterator, PackedMicroBatch
from knitkit.storage import (
    MemoryBackend,
    MiniBatchPlan,
    PlannerConfig,
    Trajectory,
    TrajectoryStore,
    pack,
    plan_minibatch,
)

Batches = tuple[MicroBatchIterator, Iterator[Mapping[str, object]]]
"""The prefetch iterator to close, and the schedule's data iterator over it."""
LOSS, UNITS = "knitkit/example/loss", "knitkit/example/units_encoded"
"""Per-step figures of the training loop, both summed over the world."""


def tiny_config_fields() -> dict[str, Any]:
    """``TransformerConfig`` fields every example's tiny model shares: this rank's TP size, weights
    initialised on the CPU (the same on every device and run), no dropout."""
    from megatron.core.parallel_state import get_tensor_model_parallel_world_size

    return {
        "tensor_model_parallel_size": get_tensor_model_parallel_world_size(),
        "use_cpu_initialization": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }


def megatron_ddp(model: torch.nn.Module, config: Any, **options: Any) -> Any:
    """The user's Megatron DDP wrap: ``model`` on this rank's device in ``DistributedDataParallel``
    (``options`` are ``DistributedDataParallelConfig`` fields), and ``config``'s ``no_sync`` and
    ``finalize_model_grads`` hooks set as the schedules expect them."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(**options), model.to(current_device())
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp


def loss_func(
    loss_mask: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The user's loss: summed masked per-token loss, with its token count (megatron's convention)."""
    loss = (output.float() * loss_mask).sum()
    return loss, loss_mask.sum().to(torch.int), {"lm loss": loss.detach()}


def plan_step(
    store: TrajectoryStore,
    ids: Sequence[str],
    layout: MegatronLayout,
    token_fields: tuple[str, ...],
    *,
    tp_sharded: bool,
) -> MiniBatchPlan:
    """knitkit's plan of one mini-batch for this Megatron layout (3 micro-batches per DP rank)."""
    config = PlannerConfig(token_fields=token_fields, scalar_fields=(), min_micro_batches=3)
    encoder = layout.encoder_topology(tp_sharded=tp_sharded)
    return plan_minibatch(store.metas(ids), layout.topology, config, encoders=[encoder])


def knitkit_batches(
    store: TrajectoryStore,
    plan: MiniBatchPlan,
    layout: MegatronLayout,
    to_batch: Callable[[MicroBatch], Mapping[str, object]],
) -> Batches:
    """This rank's packed micro-batches through knitkit's prefetch iterator, as Megatron batches."""
    dp, cp, _ = layout.coord
    consumer = plan.consumer(dp, cp)
    schema = store.schema(consumer.micro_batches[0].sequences[0].trajectory_id)
    packed = (PackedMicroBatch(*pack(mb, schema, store.read_into)) for mb in consumer.micro_batches)
    iterator = MicroBatchIterator(packed)
    return iterator, megatron_batches(iterator, to_batch)


def train_loop(
    model: Any,
    step: DedupVLMStep,
    layout: MegatronLayout,
    *,
    plan: Callable[[], MiniBatchPlan],
    batches: Callable[[MiniBatchPlan], Batches],
    forward_step: Callable[..., object],
    encode: Callable[[Sequence[Any]], torch.Tensor],
    seq_length: int,
    steps: int,
    lr: float,
    observe: MetricsObserver | None = None,
) -> list[dict[str, float]]:
    """``steps`` mini-batches through ``step.run`` (a plain SGD step stands in for the user's
    optimizer); per step the loss and the unique units encoded, both summed over the world.

    ``observe`` gets them after each step with this rank's ``step.metrics()``, as a trainer
    would hand them to its logger (``knitkit.metrics``).
    """
    history = []
    for _ in range(steps):
        mini_batch = plan()
        model.zero_grad_buffer()
        iterator, data = batches(mini_batch)
        with iterator:
            losses: list[Any] = step.run(
                forward_step_func=forward_step,
                data_iterator=data,
                route=layout.route(mini_batch),
                encode_fn=encode,
                num_microbatches=mini_batch.num_micro_batches,
                seq_length=seq_length,
                micro_batch_size=1,
            )
        for param in model.parameters():  # stand-in for the user's Megatron optimizer
            param.data.add_(param.main_grad, alpha=-lr)
        loss = torch.stack([out["lm loss"] for out in losses]).sum()
        dist.all_reduce(loss)
        units = torch.tensor(float(step.last_encoded_units), device=current_device())
        dist.all_reduce(units)
        history.append({"loss": float(loss), "encoded_units": float(units)})
        if observe is not None:
            observe(len(history), merge(step.metrics(), {LOSS: float(loss), UNITS: float(units)}))
    return history


def memory_store(trajectories: Sequence[Trajectory]) -> tuple[TrajectoryStore, list[str]]:
    """A store in this process's memory holding ``trajectories``, and their ids."""
    store = TrajectoryStore(MemoryBackend())
    for trajectory in trajectories:
        store.write(trajectory)
    return store, [t.trajectory_id for t in trajectories]


@contextlib.contextmanager
def megatron_world(
    tensor_parallel: int | None = None, *, vision_shim: bool = False
) -> Iterator[None]:
    """This torchrun world with megatron's ``parallel_state`` at ``tensor_parallel`` (default:
    the world size; DP is what the world leaves), torn down on exit.

    On GPUs: NCCL, one device per local rank. Without CUDA: gloo, with knitkit's CPU shim for
    the few places megatron-core assumes CUDA (``knitkit.integration.megatron.cpu``; with
    ``vision_shim`` also for megatron's ViT). Inside it the known third-party warnings are
    ignored (NOTE [ Known third-party warnings ]).
    """
    with warnings.catch_warnings():
        quiet_known_warnings()
        with _world(tensor_parallel, vision_shim):
            yield


# NOTE [ Known third-party warnings ]: on a machine without Transformer Engine or apex (the CPU
# run) megatron-core warns, per rank and per import site, that it falls back to torch, about
# CUDA settings and a deprecated CUDA-graph scope, and torch about megatron's use of a
# deprecated collective: 36 of the GRPO example's 79 lines, around its 3 result lines. Each is
# expected and says nothing about the example, so the examples ignore exactly these (category,
# module and message prefix), only inside ``megatron_world``; any other warning still shows.
KNOWN_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"megatron\.core\.", r"(Transformer Engine and )?Apex (is|are) not installed"),
    (UserWarning, r"megatron\.core\.transformer\.", r"full scope is deprecated"),
    (UserWarning, r"megatron\.core\.tensor_parallel\.", r"When using async grad allreduce"),
    (
        FutureWarning,
        r"torch\.distributed\.c10d_logger",
        r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
    ),
)
"""(category, module regex, message regex) of every warning ``quiet_known_warnings`` ignores."""


def quiet_known_warnings() -> None:
    """Ignore ``KNOWN_WARNINGS`` (call it inside ``warnings.catch_warnings()``; NOTE [ Known
    third-party warnings ])."""
    for category, module, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message, category, module)


@contextlib.contextmanager
def _world(tensor_parallel: int | None, vision_shim: bool) -> Iterator[None]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        tp = tensor_parallel or dist.get_world_size()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        model_parallel_cuda_manual_seed(1234)
    else:
        from knitkit.integration.megatron import cpu

        dist.init_process_group("gloo")
        tp = tensor_parallel or dist.get_world_size()
        cpu.initialize_model_parallel(tensor_parallel=tp, seed=1234)
        cpu.install_schedule_shim()
        if vision_shim:
            cpu.install_vision_shim()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def tensorboard_argument(parser: argparse.ArgumentParser) -> None:
    """``--tensorboard DIR``: rank 0 also logs each step's figures there."""
    parser.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="rank 0 also writes each step's knitkit/... figures here (knitkit[tensorboard])",
    )


def launch(
    train: Callable[..., list[dict[str, float]]], units: str, *, vision_shim: bool = False
) -> None:
    """Run ``train(observe=...)`` on every rank of this torchrun world at TP = world size
    (``megatron_world``); rank 0 prints ``step i: loss L, <units>`` per step (``units`` formats
    the encoded-units figure) and, with ``--tensorboard DIR``, writes every step's figures there.
    """
    parser = argparse.ArgumentParser(description="a knitkit example of a Megatron VLM step")
    tensorboard_argument(parser)
    args = parser.parse_args()
    with megatron_world(vision_shim=vision_shim), ExitStack() as stack:
        observers: list[MetricsObserver] = []
        if dist.get_rank() == 0:
            observers.append(functools.partial(_print_step, units))
            if args.tensorboard:
                observers.append(stack.enter_context(TensorBoardObserver(args.tensorboard)))
        train(observe=FanOut(*observers))


def _print_step(units: str, step: int, metrics: Mapping[str, float]) -> None:
    print(f"step {step}: loss {metrics[LOSS]:.4f}, {units.format(metrics[UNITS])}", flush=True)
