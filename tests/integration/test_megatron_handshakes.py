"""A Megatron dedup step meets its peers once before rows move (NOTE [ One handshake per step ]).

At TP=2 (PP=1, a replicated vision path: the encoder group is the world) ``DedupVLMStep.run``
used to run the step's own all-gather (NOTE [ Every rank refuses together ]) and then the encode
handshake: two rounds over the same ranks before the feature rows move. The step's facts now
ride in the encode handshake, so a forward-only pass makes 2 knitkit collectives (handshake,
feature rows) and a train pass 4 (plus the backward's handshake and gradient rows), counted on
the real gloo calls; the failure semantics stay: an encoder that raises on one rank raises
there and ``PeerFailed`` naming it on the peer, within seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import World
from test_megatron_agreement import PIXELS, _model, _route

from knitkit.integration.megatron import cpu as megatron_cpu
from knitkit.types import UnitKey

WORLD_TIMEOUT_S = 100.0
"""Default limit of one job on this module's lent worlds (``world2``/``world4`` in tests/conftest.py)."""

NEVER_S = 30.0
"""handshake_timeout_s: every rank arrives, so every error must come well before it."""
COUNTED = ("all_gather_into_tensor", "batch_isend_irecv")
"""knitkit's collectives: the step's all-gather, the handshakes' and rows' point-to-point batches."""


def _counted(run: Callable[[], object]) -> dict[str, int]:
    """Calls of each ``COUNTED`` collective while ``run`` runs (the real calls, counted)."""
    counts = dict.fromkeys(COUNTED, 0)
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name: str) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in COUNTED:
        setattr(dist, name, counting(name))
    try:
        run()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return counts


@contextlib.contextmanager
def _tp2_step() -> Iterator[tuple[Any, Any, Any]]:
    """A TP=2 world's replicated-vision model, it under Megatron's DDP, and a ``DedupVLMStep``
    over that; the model-parallel state torn down after."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from knitkit.integration.megatron import DedupVLMStep

    megatron_cpu.initialize_model_parallel(tensor_parallel=2)
    megatron_cpu.install_schedule_shim()
    try:
        inner = _model("replicated", finalize=True)
        model = DistributedDataParallel(inner.config, DistributedDataParallelConfig(), inner)
        yield inner, model, DedupVLMStep(model, handshake_timeout_s=NEVER_S)
    finally:
        megatron_cpu.destroy_model_parallel()


def _step(rank: int, forward_only: bool, fail_on: int | None) -> tuple[str, str, float, dict]:
    """One TP=2 step: (error type, message, seconds, knitkit collectives counted)."""
    with _tp2_step() as (inner, _, step):

        def encode(keys: Sequence[UnitKey]) -> torch.Tensor:
            if rank == fail_on:
                raise RuntimeError(f"vision path failed on rank {rank}")
            return inner.vision(torch.ones(2 * len(keys), PIXELS))

        def forward_step(data: Iterator[object], chunk: torch.nn.Module) -> tuple[object, object]:
            next(data)
            features = inner.vision()  # the step's cache lookup: this micro-batch's rows
            return features.square().mean().view(1), lambda out: (out.sum(), {"loss": out})

        def run() -> None:
            step.run(
                forward_step_func=forward_step,
                data_iterator=iter(range(2)),
                route=_route(rank, 2, 2),
                encode_fn=encode,
                num_microbatches=2,
                seq_length=8,
                micro_batch_size=1,
                forward_only=forward_only,
            )

        started = time.monotonic()
        try:
            counts = _counted(run)
        except Exception as error:
            return type(error).__name__, str(error), time.monotonic() - started, {}
        return "", "", time.monotonic() - started, counts


def _walks(rank: int) -> tuple[int, int]:
    """A forward-only pass, then a train pass, then a train pass with the vision path frozen,
    on one TP=2 ``DedupVLMStep``: (walks of the vision path's parameters, vision gradient set
    by the first train pass and untouched by the frozen one)."""
    with _tp2_step() as (inner, model, step):
        vision = inner.vision
        walks = 0
        walk = vision.named_parameters

        def counted(*args: object, **kwargs: object) -> Iterator[tuple[str, torch.nn.Parameter]]:
            nonlocal walks
            walks += 1
            return walk(*args, **kwargs)  # type: ignore[arg-type]

        vision.named_parameters = counted  # type: ignore[method-assign]

        def forward_step(data: Iterator[object], chunk: torch.nn.Module) -> tuple[object, object]:
            next(data)
            features = inner.vision()
            return features.square().mean().view(1), lambda out: (out.sum(), {"loss": out})

        def run(forward_only: bool) -> None:
            step.run(
                forward_step_func=forward_step,
                data_iterator=iter(range(2)),
                route=_route(rank, 2, 2),
                encode_fn=lambda keys: vision(torch.ones(2 * len(keys), PIXELS)),
                num_microbatches=2,
                seq_length=8,
                micro_batch_size=1,
                forward_only=forward_only,
            )

        run(True)
        run(False)
        weight = vision.weight
        trained = weight.main_grad.clone() if hasattr(weight, "main_grad") else weight.grad
        model.zero_grad_buffer()
        for param in walk():
            param[1].requires_grad_(False)
        run(False)
        frozen = weight.main_grad if hasattr(weight, "main_grad") else weight.grad
        untouched = frozen is None or not frozen.abs().sum().item()
        return walks, int(trained is not None and bool(trained.abs().sum().item()) and untouched)


@pytest.mark.parametrize(("forward_only", "expected"), [(True, 2), (False, 4)])
def test_step_meets_its_peers_once_before_rows_move(
    world2: World, forward_only: bool, expected: int
) -> None:
    """No all-gather of its own: the step's facts ride in the encode handshake, so a pass makes
    one knitkit collective per handshake and per row exchange (3 and 5 before)."""
    for kind, message, _, counts in world2.run(_step, forward_only, None):
        assert kind == "", message
        assert counts == {"all_gather_into_tensor": 0, "batch_isend_irecv": expected}, counts


def test_encoder_failure_still_names_the_failing_rank(world2: World) -> None:
    """The encoder raising on rank 1: rank 1 raises its own error, rank 0 ``PeerFailed`` naming
    rank 1 and the error, both within seconds (the failure travels in the one handshake)."""
    (kind0, message0, took0, _), (kind1, message1, took1, _) = world2.run(_step, False, 1)
    assert (kind1, message1) == ("RuntimeError", "vision path failed on rank 1")
    assert kind0 == "PeerFailed", message0
    assert "rank 1 failed: RuntimeError: vision path failed on rank 1" in message0, message0
    assert max(took0, took1) < NEVER_S / 2, (took0, took1)


def test_vision_parameters_walked_once_per_step_object(world2: World) -> None:
    """NOTE [ The vision path found once ]: three passes on one ``DedupVLMStep`` walk the
    vision path's parameters once (3 walks per pass before: the handshake choice, the TP
    sharding check, the TP sum), and a vision path frozen between passes is still seen as
    frozen (which parameters require a gradient is read each pass)."""
    for walks, trained_then_frozen in world2.run(_walks):
        assert walks == 1, walks
        assert trained_then_frozen == 1
