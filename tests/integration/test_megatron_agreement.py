"""Every rank refuses a bad Megatron step together, before any collective (issue 22, items 13 and 15).

Each case gives one rank of a real megatron-core world (gloo, ``parallel_state`` at PP=2 or TP=2)
an input the others do not share: a ``num_microbatches`` that disagrees with its route or with
the other stage, a forward-only pass on one stage, a first stage without
``finalize_model_grads_func``, the route of another rank, or a vision path whose TP sharding
(megatron's ``tensor_model_parallel`` marks) contradicts ``DedupVLMStep(tp_sharded_vision=...)``.
Before, the one rank raised alone and its peers blocked in a collective until the group timeout
(or, for the sharding, the step ran, with gradients 77-88% off). Now EVERY rank raises
``StepRefused`` at once, with a message that names the ranks, their stage and the disagreement;
the forward step is never reached. A stage that never starts the step fails the other within
``handshake_timeout_s``; agreeing ranks pass and run the step. Bounds: ``handshake_timeout_s`` =
30 s (5 s where the peer never comes), each case within 100 s (under the test world's 120 s group
timeout, so a hang fails the case).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from dist import World, run_world

from knitkit.encoder_dedup import (
    BackboneAssignment,
    EncoderAssignment,
    RankRoute,
    RowSlice,
    build_routing_plan,
)
from knitkit.integration.megatron import cpu as megatron_cpu
from knitkit.types import UnitKey

HIDDEN, PIXELS = 8, 4
NEVER_S = 30.0
"""handshake_timeout_s: every rank arrives, so every error must come well before it."""
OUTER_S = 100.0
WORLD_TIMEOUT_S = OUTER_S
"""Default limit of one job on this module's lent worlds (``world2``/``world4`` in tests/conftest.py)."""
UNITS = (UnitKey("a", "image"), UnitKey("b", "image"))


def _route(rank: int, world: int, micro_batches: int) -> RankRoute:
    """Rank r encodes unit r (2 rows); every rank consumes every unit in each micro-batch."""
    rows = {UNITS[r]: 2 for r in range(world)}
    encoder = EncoderAssignment({r: [[UNITS[r]]] for r in range(world)}, rows)
    pieces = [RowSlice(key, 0, 2) for key in rows]
    backbone = BackboneAssignment({r: [pieces] * micro_batches for r in range(world)})
    return build_routing_plan(encoder, backbone, world_size=world).for_rank(rank)


def _model(vision: str, finalize: bool) -> torch.nn.Module:
    """A megatron module holding a vision path (first stage only): megatron's TP-sharded
    ``MultimodalProjector`` (column- then row-parallel) or a replicated ``torch.nn.Linear``."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import MegatronModule, TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules

    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    config.finalize_model_grads_func = finalize_model_grads if finalize else None

    class VLM(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder
            self.set_input_tensor = lambda tensor: None  # as megatron's schedules expect
            if not ps.is_pipeline_first_stage():
                return
            self.vision: torch.nn.Module = (
                MultimodalProjector(
                    config,
                    MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                    "mlp",
                    PIXELS,
                )
                if vision == "sharded"
                else torch.nn.Linear(PIXELS, HIDDEN)
            )

    return VLM()


def _never_runs(*args: object, **kwargs: object) -> object:
    raise AssertionError("the schedule ran a step that every rank should have refused")


def _refused(rank: int, case: str) -> tuple[str, str, float]:
    """One rank of ``case``: (error type, message, seconds in ``run``)."""
    from megatron.core import parallel_state as ps

    from knitkit.integration.megatron import DedupVLMStep

    pipeline = 2 if case.startswith("pp_") else 1
    megatron_cpu.initialize_model_parallel(
        tensor_parallel=2 // pipeline, pipeline_parallel=pipeline
    )
    megatron_cpu.install_pipeline_shim()
    try:
        stage = ps.get_pipeline_model_parallel_rank()
        declared_sharded = case == "tp_replicated_declared_sharded"
        vision = "sharded" if case == "tp_sharded_declared_replicated" else "replicated"
        model = _model(vision, finalize=not (case == "pp_no_finalize" and stage == 0))
        step = DedupVLMStep(model, tp_sharded_vision=declared_sharded, handshake_timeout_s=NEVER_S)
        # The encoder group: the stage (1 rank) at PP=2, the world at TP=2 unless TP-sharded.
        group = 2 if pipeline == 1 and not declared_sharded else 1
        other_plan = case == "pp_counts" and stage == 1  # consistent in itself
        passed = 4 if case in ("pp_route_vs_count", "pp_counts") and stage == 1 else 3
        for_rank = 0 if group == 1 or case == "tp_route_of_another_rank" else rank
        route = _route(for_rank, group, 4 if other_plan else 3)

        def encode(keys: Sequence[UnitKey]) -> torch.Tensor:  # 2 rows per unit
            vision = model.vision
            out = vision(torch.ones(2 * len(keys), PIXELS))
            return out[0] if isinstance(out, tuple) else out

        started = time.monotonic()
        try:
            step.run(
                forward_step_func=_never_runs,
                data_iterator=iter(()),
                route=route,
                encode_fn=encode,
                num_microbatches=passed,
                seq_length=8,
                micro_batch_size=1,
                forward_only=case == "pp_forward_only" and stage == 1,
            )
        except Exception as error:
            return type(error).__name__, str(error), time.monotonic() - started
        return "", "no error", time.monotonic() - started
    finally:
        megatron_cpu.destroy_model_parallel()


def _agreeing(rank: int) -> str:
    """Stages that agree pass ``check_microbatches_agree`` (the agreement refuses nothing else)."""
    from knitkit.integration.megatron import check_microbatches_agree

    megatron_cpu.initialize_model_parallel(pipeline_parallel=2)
    try:
        check_microbatches_agree(3, timeout_s=NEVER_S)
        return "agreed"
    finally:
        megatron_cpu.destroy_model_parallel()


def _agreeing_step(rank: int) -> dict[str, float]:
    """DP=2: a step every rank agrees on runs through the schedule; its dedup figures."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from knitkit.integration.megatron import DedupVLMStep

    megatron_cpu.initialize_model_parallel()
    megatron_cpu.install_schedule_shim()
    try:
        inner = _model("replicated", finalize=True)
        model = DistributedDataParallel(inner.config, DistributedDataParallelConfig(), inner)
        step = DedupVLMStep(model, handshake_timeout_s=NEVER_S)

        def forward_step(data: Iterator[object], chunk: torch.nn.Module) -> tuple[object, object]:
            next(data)
            features = inner.vision()  # the step's cache lookup: this micro-batch's rows
            return features.square().mean().view(1), lambda out: (out.sum(), {"loss": out})

        step.run(
            forward_step_func=forward_step,
            data_iterator=iter(range(2)),
            route=_route(rank, 2, 2),
            encode_fn=lambda keys: inner.vision(torch.ones(2 * len(keys), PIXELS)),
            num_microbatches=2,
            seq_length=8,
            micro_batch_size=1,
        )
        assert float(inner.vision.weight.main_grad.abs().sum()) > 0
        return step.metrics()
    finally:
        megatron_cpu.destroy_model_parallel()


def _never_starts(rank: int, limit: float) -> tuple[str, str, float]:
    """PP=2: stage 1 never calls run (it is stuck elsewhere); stage 0's outcome."""
    megatron_cpu.initialize_model_parallel(pipeline_parallel=2)
    megatron_cpu.install_pipeline_shim()
    if rank == 1:
        return "", "stayed away", 0.0
    from knitkit.integration.megatron import DedupVLMStep

    step = DedupVLMStep(_model("replicated", finalize=True), handshake_timeout_s=limit)
    started = time.monotonic()
    try:
        step.run(
            forward_step_func=_never_runs,
            data_iterator=iter(()),
            route=_route(0, 1, 3),
            encode_fn=lambda keys: torch.empty(0, HIDDEN),
            num_microbatches=3,
            seq_length=8,
            micro_batch_size=1,
        )
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - started
    return "", "no error", time.monotonic() - started


def _every_rank_refuses(world: World, case: str, *expected: str) -> list[str]:
    messages = []
    for rank, (kind, message, took) in enumerate(world.run(_refused, case)):
        assert kind == "StepRefused", (rank, kind, message)
        assert took < NEVER_S / 2, f"rank {rank} took {took:.1f} s: {message}"
        assert "every rank raises this error" in message, message
        for text in expected:
            assert text in message, (rank, text, message)
        messages.append(message)
    return messages


CASES: dict[str, tuple[str, ...]] = {
    # item 13: PP=2; stage 1 is rank 1
    "pp_route_vs_count": (
        "Ranks [1] (pipeline stages [1]) refuse: route covers 3 backbone micro-batches but "
        "num_microbatches=4",
        "Ranks disagree on num_microbatches (between 3 and 4: 3 on ranks [0]; 4 on ranks [1])",
    ),
    "pp_counts": (
        "Ranks disagree on num_microbatches (between 3 and 4",
        "Ranks disagree on the plan (route fingerprints) (ranks [0]; ranks [1])",
    ),
    "pp_forward_only": ("Ranks disagree on forward_only (False on ranks [0]; True on ranks [1])",),
    "pp_no_finalize": (
        "Ranks [0] (pipeline stages [0]) refuse: config.finalize_model_grads_func is None",
    ),
    # item 15: TP=2; both ranks hold the vision path
    "tp_sharded_declared_replicated": (
        "Ranks [0, 1] (pipeline stages [0]) refuse: the vision path is TP-sharded",
        "tensor_model_parallel=True, e.g. vision.encoder.linear_fc1.weight with partition_dim=0",
        "pass DedupVLMStep(tp_sharded_vision=True) and plan with "
        "MegatronLayout.encoder_topology(tp_sharded=True)",
    ),
    "tp_route_of_another_rank": (
        "Ranks [1] (pipeline stages [0]) refuse: ValueError: route is for rank 0 but the "
        "transport is rank 1",
    ),
    "tp_replicated_declared_sharded": (
        "Ranks [0, 1] (pipeline stages [0]) refuse: DedupVLMStep(tp_sharded_vision=True) but no "
        "parameter of the vision path ['vision'] is TP-sharded",
        "pass tp_sharded_vision=False",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_refuses_promptly(world2: World, case: str) -> None:
    """A check that fails on one rank (or differs between ranks) raises StepRefused on every
    rank within seconds, naming the rank, its pipeline stage and the disagreement; nothing ran."""
    _every_rank_refuses(world2, case, *CASES[case])


def test_agreeing_stages_pass(world2: World) -> None:
    """The same agreement lets agreeing stages through (and leaves the world usable)."""
    assert world2.run(_agreeing) == ["agreed", "agreed"]


def test_agreeing_step_runs_and_reports_its_figures(world2: World) -> None:
    """DP=2, every rank agreeing: the step runs the schedule, and DedupVLMStep.metrics() gives
    this rank's dedup figures (one unit of 2 rows encoded, 4 rows cached, 8 served)."""
    for figures in world2.run(_agreeing_step):
        counts = {k: v for k, v in figures.items() if not k.endswith("_s")}
        assert counts == {
            "knitkit/dedup/units_encoded": 1.0,
            "knitkit/dedup/rows_encoded": 2.0,
            "knitkit/dedup/rows_cached": 4.0,
            "knitkit/dedup/rows_served": 8.0,
        }, figures
        assert figures["knitkit/dedup/backward_s"] > 0, figures


def test_rank_that_never_starts_the_step_is_bounded() -> None:
    """A stage that never starts the step: the other fails within handshake_timeout_s with a
    TimeoutError naming the step, not the process group's timeout."""
    limit = 2.0  # the peer never arrives, so a short bound cannot flake on a loaded machine
    kind, message, took = run_world(_never_starts, 2, limit, timeout_s=OUTER_S)[0]
    assert kind == "TimeoutError", (kind, message)
    assert "did not reach 'step' within 2 s" in message, message
    assert limit <= took < OUTER_S / 2, took
