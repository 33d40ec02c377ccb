"""Gradient equivalence of the wrapped Megatron VLM step against the unwrapped one (gloo on CPU, NCCL on GPU).

Every case runs ``knitkit.integration.megatron.testing.check_equivalence`` on the example's model
(``examples/megatron_wrap.py``), the same check users run on theirs. The unwrapped reference is the
user's step as is: every backbone micro-batch hands its vision path the images its placeholder
tokens consume (``images`` in the batch), under ``get_forward_backward_func()`` with Megatron DDP;
one case uses the check's default re-encoding reference instead. The wrapped step is
``DedupVLMStep``: each unique image encoded once on one rank of the world, features routed to the
(DP, CP, TP) consumers, one deferred encoder backward before ``finalize_model_grads``. Both models
come from the same seed and run the same knitkit plan twice, with an SGD update in between (so
Megatron DDP's first-batch and later-batch paths both run), with a replicated vision path
(owner-computes across the world, TP-owned gradient slices, TP sum in finalize) and with megatron's
TP-sharded ``MultimodalProjector`` (TP peers encode together).

Tolerance (fp32), per parameter: ``max|g_wrapped - g_ref| <= RTOL * max(max|g_ref|, FLOOR)`` with
``RTOL = 1e-4`` and ``FLOOR = 1e-6``; every parameter's reference gradient must be above the floor
(none is compared only absolutely) and the worst relative error is asserted below ``RTOL``. The two
differ only in summation order (features summed over micro-batches, encoder gradients over ranks);
measured worst relative error: ~1e-6.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import World
from unwrapped_batches import with_images

from knitkit.encoder_dedup import EquivalenceReport
from knitkit.integration.megatron import cpu as megatron_cpu
from knitkit.integration.megatron.testing import VLMUnderTest, check_equivalence

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import megatron_wrap as user

WORLD_TIMEOUT_S = 240.0
"""Default limit of one job on this module's lent worlds (``world2``/``world4`` in tests/conftest.py)."""

RTOL, FLOOR = 1e-4, 1e-6
STEPS, LR = 2, 0.5


def _equivalence(
    rank: int,
    tensor_parallel: int,
    overlap: bool,
    sharded: bool,
    samples: int = 4,
    options: dict[str, bool] | None = None,
    reencoding_reference: bool = False,
) -> EquivalenceReport:
    """One rank of ``check_equivalence`` on the example's model (twin builds, two mini-batches).

    ``options`` go to ``build_model`` (``vision_transformer``, ``sequence_parallel``, ...);
    ``megatron_optimizer`` steps both models with megatron's optimizer (SGD; the
    ``DistributedOptimizer`` with ``distributed_optimizer``; needs CUDA), after which the
    parameters are compared too.
    """
    megatron_cpu.initialize_model_parallel(tensor_parallel=tensor_parallel)
    megatron_cpu.install_schedule_shim()
    try:
        options = dict(options or {})
        use_optimizer = bool(options.pop("megatron_optimizer", False))
        if options.get("sequence_parallel", False):
            options["block_spec"] = megatron_cpu.sequence_parallel_block_spec(  # type: ignore[assignment]
                qk_layernorm=options.get("vision_transformer", False)
            )
        subject = VLMUnderTest(
            provider=functools.partial(
                user.build_model, overlap, tp_sharded_projector=sharded, **options
            ),
            forward_step=user.forward_step,
            tp_sharded_vision=sharded,
            reference_batches=None if reencoding_reference else with_images,
        )
        return check_equivalence(
            subject,
            functools.partial(user.grpo_trajectories, 0, samples),
            rtol=RTOL,
            floor=FLOOR,
            steps=STEPS,
            # the distributed optimizer steps only this rank's shard: no plain SGD then
            lr=0.0 if options.get("distributed_optimizer") and not use_optimizer else LR,
            optimizer=functools.partial(_optimizer, options=options) if use_optimizer else None,
        )
    finally:
        megatron_cpu.destroy_model_parallel()


def _optimizer(chunks: list[torch.nn.Module], options: dict[str, object]) -> object:
    """Megatron's optimizer for one model: SGD, distributed when the model's buffers are sharded."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="sgd",
        lr=LR,
        sgd_momentum=0.0,
        weight_decay=0.0,
        clip_grad=0.0,
        use_distributed_optimizer=bool(options.get("distributed_optimizer", False)),
        overlap_param_gather=bool(options.get("overlap_param_gather", False)),
    )
    return get_megatron_optimizer(config, chunks)


def _check(
    results: list[EquivalenceReport],
    tensor_parallel: int,
    sharded: bool,
    samples: int = 4,
    below_floor: tuple[str, ...] = (),
) -> float:
    """Assert equivalence, the floor and dedup on the merged report; returns the worst relative error."""
    report = results[0]
    assert all(r == report for r in results), "every rank must hold the same merged report"
    print(report.table())
    report.raise_if_failed(expect_below_floor=below_floor)  # the others are above FLOOR
    assert report.worst_relative_error <= RTOL, report.worst_relative_error
    assert any(c.name.startswith("vision.") and c.status == "ok" for c in report.gradients)
    assert {c.name for c in report.outputs} >= {"train[lm loss]", "forward_only[lm loss]"}
    # Dedup: the world encodes each unique image once per mini-batch (with every TP peer when the
    # vision path is TP-sharded); the reference encodes every consumed piece on every rank.
    unique = len({i.key for t in user.grpo_trajectories(0, samples) for i in t.multimodal})
    assert report.units_with_dedup == unique * STEPS * (tensor_parallel if sharded else 1)
    assert report.units_without_dedup > report.units_with_dedup
    return report.worst_relative_error


def _mismatched_route(rank: int) -> str:
    """A plan for a replicated vision path run with ``tp_sharded_vision=True``: the error text."""
    from knitkit.integration.megatron import DedupVLMStep, MegatronLayout
    from knitkit.storage import MemoryBackend, TrajectoryStore

    megatron_cpu.initialize_model_parallel(tensor_parallel=2)
    megatron_cpu.install_schedule_shim()
    try:
        layout = MegatronLayout.from_parallel_state()
        store = TrajectoryStore(MemoryBackend())
        trajectories = user.grpo_trajectories(seed=0)
        for trajectory in trajectories:
            store.write(trajectory)
        plan = user.plan_step(store, [t.trajectory_id for t in trajectories], layout)
        step = DedupVLMStep(user.build_model(False), tp_sharded_vision=True)
        try:
            step.run(
                forward_step_func=user.forward_step,
                data_iterator=iter(()),
                route=layout.route(plan),
                encode_fn=lambda keys: torch.empty(0),
                num_microbatches=plan.num_micro_batches,
                seq_length=user.MAX_SEQ,
                micro_batch_size=1,
            )
        except ValueError as error:
            return str(error)
        return "no error"
    finally:
        megatron_cpu.destroy_model_parallel()


def _layout(rank: int, tensor_parallel: int, context_parallel: int) -> dict[str, object]:
    """The layout read from parallel_state, and this CP rank's packed tokens vs megatron's CP split."""
    import numpy as np
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from knitkit.integration.megatron import MegatronLayout
    from knitkit.storage import (
        MemoryBackend,
        PlannerConfig,
        Trajectory,
        TrajectoryStore,
        pack,
        plan_minibatch,
    )

    megatron_cpu.initialize_model_parallel(
        tensor_parallel=tensor_parallel, context_parallel=context_parallel
    )
    try:
        layout = MegatronLayout.from_parallel_state()
        groups = {
            "tp": dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()),
            "cp": dist.get_process_group_ranks(parallel_state.get_context_parallel_group()),
            "dp": dist.get_process_group_ranks(parallel_state.get_data_parallel_group()),
        }
        store = TrajectoryStore(MemoryBackend())
        lengths = {"t0": 13, "t1": 9}  # padded to multiples of 2*cp
        for name, length in lengths.items():
            store.write(
                Trajectory(name, name, {"tokens": np.arange(1, length + 1, dtype=np.int64)})
            )
        plan = plan_minibatch(
            store.metas(list(lengths)),
            layout.topology,
            PlannerConfig(token_fields=("tokens",), scalar_fields=()),
        )
        split_equal = []
        for mb in plan.consumer(*layout.coord[:2]).micro_batches:
            packed_layout, buffer = pack(mb, store.schema("t0"), store.read_into)
            packed = torch.from_numpy(packed_layout.numpy_views(buffer)["tokens"].copy())
            for seq, piece in zip(
                mb.sequences, packed.split([s.local_length for s in mb.sequences]), strict=True
            ):
                whole = torch.zeros(seq.padded_length, dtype=torch.int64)
                whole[: seq.num_tokens] = torch.arange(1, seq.num_tokens + 1)
                megatron = get_batch_on_this_cp_rank({"tokens": whole[None]})["tokens"][0]
                split_equal.append(bool(torch.equal(piece, megatron)))
        return {
            "topology": layout.topology,
            "coords": layout.coords,
            "groups": groups,
            "cp_split_equal": split_equal,
        }
    finally:
        megatron_cpu.destroy_model_parallel()


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
VISION = pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "tp_sharded"])


@OVERLAP
@VISION
def test_tp2_wrapped_step_matches_unwrapped(world2: World, overlap: bool, sharded: bool) -> None:
    """TP=2: every encoder, projector and backbone gradient equals the re-encoding reference."""
    _check(world2.run(_equivalence, 2, overlap, sharded), 2, sharded)


def test_tp2_default_reencoding_reference(world2: World) -> None:
    """TP=2 with the check's own baseline (NOTE [ Re-encoding reference ]): the vision path
    re-encodes, per micro-batch, the pieces it consumes; the same equivalence holds."""
    _check(world2.run(_equivalence, 2, True, False, 4, None, True), 2, False)


@OVERLAP
@VISION
def test_dp2_tp2_wrapped_step_matches_unwrapped(
    world4: World, overlap: bool, sharded: bool
) -> None:
    """DP=2 x TP=2: same equivalence with encodings routed across DP (and TP-owned gradient slices)."""
    _check(world4.run(_equivalence, 2, overlap, sharded), 2, sharded)


VIT_SP = {"vision_transformer": True, "sequence_parallel": True}
VIT_BELOW_FLOOR = ("vision.encoder.layers.0.self_attention.k_layernorm.bias",)
"""The ViT's key-layernorm bias: without a positional rotation after it, it shifts every logit of
a query alike, so softmax gives it an exactly-zero gradient (measured ~1e-14, below FLOOR)."""


@pytest.mark.slow
def test_tp2_sharded_vision_transformer_sequence_parallel(world2: World) -> None:
    """TP=2, sequence parallel: a TP-sharded ViT with q/k layernorm and SP-tagged norms and
    row-parallel biases gets megatron's TP reduction in finalize, so every gradient (those
    included) equals the unwrapped step's, and both TP ranks hold the same replicated gradients."""
    _check(world2.run(_equivalence, 2, False, True, 4, VIT_SP), 2, True, 4, VIT_BELOW_FLOOR)


@pytest.mark.slow
def test_dp2_tp2_sharded_vision_transformer_sequence_parallel(world4: World) -> None:
    """DP=2 x TP=2, sequence parallel, overlapped grad reduce: the same equivalence as at TP=2."""
    _check(world4.run(_equivalence, 2, True, True, 4, VIT_SP), 2, True, 4, VIT_BELOW_FLOOR)


DIST_OPT = {"distributed_optimizer": True}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overlap", "sharded"),
    [(False, False), (True, True)],
    ids=["overlap_off-replicated", "overlap_on-tp_sharded"],
)
def test_dp2_tp2_distributed_optimizer_shards_match_unwrapped(
    world4: World, overlap: bool, sharded: bool
) -> None:
    """DP=2 x TP=2, DDP(use_distributed_optimizer=True): after the reduce-scatter every rank's
    gradient shard (what its DistributedOptimizer steps) equals the unwrapped step's, for two
    consecutive mini-batches. DistributedOptimizer.step() and overlap_param_gather need CUDA
    (megatron's optimizer checks ``torch.cuda.FloatTensor``): ``*_nccl`` variants below."""
    _check(world4.run(_equivalence, 2, overlap, sharded, 4, DIST_OPT), 2, sharded)


def test_route_and_step_must_agree_on_the_vision_layout(world2: World) -> None:
    """A route planned for a replicated vision path fails fast under tp_sharded_vision=True (no hang)."""
    for message in world2.run(_mismatched_route):
        assert "encoder_topology(tp_sharded=True)" in message, message


def test_dp2_tp2_rank_with_nothing_to_encode(world4: World) -> None:
    """3 unique images over 4 encoding ranks, overlap on: the idle rank still satisfies DDP's buckets."""
    _check(world4.run(_equivalence, 2, True, False, 2), 2, False, samples=2)


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs CUDA: 2 GPUs for a 2-rank NCCL world")
@OVERLAP
@VISION
def test_tp2_wrapped_step_matches_unwrapped_nccl(overlap: bool, sharded: bool) -> None:
    """TP=2 on GPUs with NCCL: the same equivalence as on CPU."""
    with World(2, backend="nccl", timeout_s=300) as world:
        _check(world.run(_equivalence, 2, overlap, sharded), 2, sharded)


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_devices() < 4, reason="needs CUDA: 4 GPUs for a 4-rank NCCL world")
@OVERLAP
@VISION
def test_dp2_tp2_wrapped_step_matches_unwrapped_nccl(overlap: bool, sharded: bool) -> None:
    """DP=2 x TP=2 on GPUs with NCCL: the same equivalence as on CPU."""
    with World(4, backend="nccl", timeout_s=300) as world:
        _check(world.run(_equivalence, 2, overlap, sharded), 2, sharded)


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_devices() < 4, reason="needs CUDA: 4 GPUs for a 4-rank NCCL world")
@pytest.mark.parametrize("param_gather", [False, True], ids=["gather_sync", "overlap_param_gather"])
@OVERLAP
@VISION
def test_dp2_tp2_distributed_optimizer_step_nccl(
    overlap: bool, sharded: bool, param_gather: bool
) -> None:
    """DP=2 x TP=2 on GPUs: DistributedOptimizer.step() on both models, two consecutive
    mini-batches; every rank's gradient shard and every stepped parameter match the unwrapped step."""
    options = {
        "distributed_optimizer": True,
        "overlap_param_gather": param_gather,
        "megatron_optimizer": True,
    }
    with World(4, backend="nccl", timeout_s=300) as world:
        _check(world.run(_equivalence, 2, overlap, sharded, 4, options), 2, sharded)


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs CUDA: 2 GPUs for a 2-rank NCCL world")
def test_tp2_sharded_vision_transformer_sequence_parallel_nccl() -> None:
    """TP=2 on GPUs with NCCL: the sequence-parallel ViT equivalence as on CPU."""
    with World(2, backend="nccl", timeout_s=300) as world:
        _check(world.run(_equivalence, 2, True, True, 4, VIT_SP), 2, True, 4, VIT_BELOW_FLOOR)


@pytest.mark.parametrize(("tp", "cp"), [(2, 1), (1, 2)])
def test_layout_comes_from_parallel_state(world2: World, tp: int, cp: int) -> None:
    """MegatronLayout matches parallel_state's groups; the planner's CP split equals get_batch_on_this_cp_rank."""
    from knitkit.storage import Topology

    results = world2.run(_layout, tp, cp)
    for rank, result in enumerate(results):
        assert result["topology"] == Topology(dp=1, cp=cp, tp=tp)
        _, cp_rank, tp_rank = result["coords"][rank]
        groups = result["groups"]
        assert groups["tp"][tp_rank] == rank and groups["cp"][cp_rank] == rank
        assert result["cp_split_equal"] and all(result["cp_split_equal"]), (
            f"rank {rank}: CP split differs from megatron's: {result['cp_split_equal']}"
        )
    assert results[0]["coords"] == results[1]["coords"]


def test_layout_dp2_tp2(world4: World) -> None:
    """DP=2 x TP=2: every rank's (dp, cp, tp) coordinate is its place in parallel_state's groups."""
    from knitkit.storage import Topology

    results = world4.run(_layout, 2, 1)
    coords = results[0]["coords"]
    assert sorted(coords) == [(d, 0, t) for d in range(2) for t in range(2)]
    for rank, result in enumerate(results):
        assert result["topology"] == Topology(dp=2, cp=1, tp=2)
        dp_rank, _, tp_rank = coords[rank]
        assert result["groups"]["tp"][tp_rank] == rank
        assert result["groups"]["dp"][dp_rank] == rank
