"""Gradient equivalence of the wrapped Megatron VLM step against the unwrapped one (gloo on CPU, NCCL on GPU).

The unwrapped reference is the user's step as is: every backbone micro-batch re-encodes the images
its placeholder tokens consume, under ``get_forward_backward_func()`` with Megatron DDP. The wrapped
step is ``DedupVLMStep``: each unique image encoded once on one rank of the world, features routed
to the (DP, CP, TP) consumers, one deferred encoder backward before ``finalize_model_grads``.
Both run the same model (same seed), the same knitkit plan and packed micro-batches, two mini-batches
with an SGD update in between (so Megatron DDP's first-batch and later-batch paths both run), with a
replicated vision path (owner-computes across the world, TP-owned gradient slices, TP sum after
finalize) and with megatron's TP-sharded ``MultimodalProjector`` (TP peers encode together).

Tolerance (fp32): per parameter, ``max|g_wrapped - g_ref| <= 1e-5 + 1e-4 * max|g_ref|``; the two
differ only in summation order (features summed over micro-batches, encoder gradients over ranks);
measured here, every difference is already below ``1e-4 * max|g_ref|``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import megatron_cpu
import pytest
import torch
import torch.distributed as dist
from dist import World

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import megatron_wrap as user

ATOL, RTOL = 1e-5, 1e-4
STEPS, LR = 2, 0.5


def _equivalence(
    rank: int,
    tensor_parallel: int,
    overlap: bool,
    sharded: bool,
    samples: int = 4,
    options: dict[str, bool] | None = None,
) -> dict[str, object]:
    """One rank: reference and wrapped steps on twin models; per-parameter gradient differences.

    ``options`` go to ``build_model`` (``vision_transformer``, ``sequence_parallel``, ...);
    ``megatron_optimizer`` steps both models with megatron's optimizer (SGD; the
    ``DistributedOptimizer`` with ``distributed_optimizer``; needs CUDA) and compares the
    parameters after every step too.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from knitkit.integration.megatron import DedupVLMStep, MegatronLayout, feature_slices
    from knitkit.storage import MemoryBackend, TrajectoryStore

    megatron_cpu.initialize_model_parallel(tensor_parallel=tensor_parallel)
    megatron_cpu.install_schedule_shim()
    try:
        options = dict(options or {})
        use_optimizer = bool(options.pop("megatron_optimizer", False))
        sequence_parallel = options.get("sequence_parallel", False)
        if sequence_parallel:
            options["block_spec"] = megatron_cpu.sequence_parallel_block_spec(
                qk_layernorm=options.get("vision_transformer", False)
            )
        layout = MegatronLayout.from_parallel_state(sequence_parallel=sequence_parallel)
        reference = user.build_model(overlap, tp_sharded_projector=sharded, **options)
        wrapped = user.build_model(overlap, tp_sharded_projector=sharded, **options)
        step = DedupVLMStep(wrapped, vision="vision", tp_sharded_vision=sharded)
        optimizers = [_optimizer(m, options) for m in (reference, wrapped)] if use_optimizer else []
        store = TrajectoryStore(MemoryBackend())
        device = user._device()

        def pixels(key):  # type: ignore[no-untyped-def]
            return torch.from_numpy(store.read(key)).to(device)

        def encode(keys):  # type: ignore[no-untyped-def]
            return torch.cat([wrapped.module.vision.encode(pixels(k)) for k in keys])

        worst: dict[str, float] = {}
        worst_rel = 0.0
        references = encoded = 0
        for mini_batch in range(STEPS):
            trajectories = user.grpo_trajectories(seed=mini_batch, samples=samples)
            for trajectory in trajectories:
                store.write(trajectory)
            ids = [t.trajectory_id for t in trajectories]
            plan = user.plan_step(store, ids, layout, tp_sharded=sharded)
            consumer = plan.consumer(*layout.coord[:2])

            reference.zero_grad_buffer()
            iterator, data = user.knitkit_batches(store, plan, layout)
            with iterator:
                pieces = [feature_slices(mb) for mb in consumer.micro_batches]
                references += sum(len(p) for p in pieces)
                with_images = (
                    dict(batch, images=[(pixels(s.key), s.start, s.stop) for s in piece])
                    for batch, piece in zip(data, pieces, strict=True)
                )
                get_forward_backward_func()(
                    forward_step_func=user.forward_step,
                    data_iterator=with_images,
                    model=[reference],
                    num_microbatches=plan.num_micro_batches,
                    seq_length=user.MAX_SEQ,
                    micro_batch_size=1,
                )

            wrapped.zero_grad_buffer()
            iterator, data = user.knitkit_batches(store, plan, layout)
            with iterator:
                step.run(
                    forward_step_func=user.forward_step,
                    data_iterator=data,
                    route=layout.route(plan),
                    encode_fn=encode,
                    num_microbatches=plan.num_micro_batches,
                    seq_length=user.MAX_SEQ,
                    micro_batch_size=1,
                )
            encoded += step.last_encoded_units

            sharded_grads = options.get("distributed_optimizer", False)
            for (name, ref), mine in zip(
                reference.module.named_parameters(), wrapped.module.parameters(), strict=True
            ):
                ref_grad, my_grad = _owned(reference, ref), _owned(wrapped, mine)
                if not sharded_grads:
                    assert ref_grad.numel() == ref.numel()
                if ref_grad.numel() == 0:
                    continue  # no element of this parameter is in this rank's shard
                excess = (my_grad - ref_grad).abs().max() - RTOL * ref_grad.abs().max()
                worst[name] = max(worst.get(name, -1.0), float(excess))
                scale = float(ref_grad.abs().max())
                if scale > ATOL:  # below it only the absolute tolerance means anything
                    diff = float((my_grad - ref_grad).abs().max())
                    worst_rel = max(worst_rel, diff / scale)
                if not sharded_grads and not optimizers:  # manual SGD on whole gradients
                    for param in (ref, mine):
                        param.data.add_(param.main_grad, alpha=-LR)
            for optimizer in optimizers:
                assert optimizer.step()[0], "megatron's optimizer skipped the step"
            for model in (reference, wrapped) if optimizers else ():
                if model.ddp_config.overlap_param_gather:  # otherwise the next forward gathers
                    model.start_param_sync(force_sync=True)
            for (name, ref), mine in zip(
                reference.module.named_parameters(), wrapped.module.parameters(), strict=True
            ):
                if optimizers:  # the stepped (and gathered) parameters agree as well
                    excess = (mine - ref).abs().max() - RTOL * ref.abs().max()
                    worst["param:" + name] = max(worst.get("param:" + name, -1.0), float(excess))
        restored = type(wrapped.module.vision) is type(reference.module.vision) and (
            wrapped.config.finalize_model_grads_func is reference.config.finalize_model_grads_func
        )
        return {
            "worst_excess": worst,
            "worst_rel": worst_rel,
            "references": references,
            "encoded": encoded,
            "restored": restored,
        }
    finally:
        megatron_cpu.destroy_model_parallel()


def _optimizer(model: object, options: dict[str, object]) -> object:
    """Megatron's optimizer for ``model``: SGD, distributed when the model's buffers are sharded."""
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
    return get_megatron_optimizer(config, [model])


def _owned(ddp: object, param: torch.nn.Parameter) -> torch.Tensor:
    """The part of ``param.main_grad`` whose reduction this rank owns.

    All of it with a plain DDP all-reduce; with ``use_distributed_optimizer`` the elements in
    this DP rank's shard of the parameter's bucket (megatron's ``shard_buffer``), the only ones
    the reduce-scatter makes valid and the only ones this rank's optimizer steps.
    """
    from megatron.core import parallel_state

    flat = param.main_grad.view(-1)
    if not ddp.ddp_config.use_distributed_optimizer:  # type: ignore[attr-defined]
        return flat
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for buffer in ddp.buffers:  # type: ignore[attr-defined]
        if param in buffer.param_index_map:
            start, end, bucket_id = buffer.param_index_map[param]
            bucket = buffer.buckets[bucket_id]
            shard = bucket.grad_data.numel() // size
            lo = max(start, bucket.offset + rank * shard)
            hi = min(end, bucket.offset + (rank + 1) * shard)
            return flat[max(lo - start, 0) : max(hi - start, 0)]
    raise AssertionError("parameter is in none of megatron DDP's buffers")


def _check(
    results: list[dict[str, object]], tensor_parallel: int, sharded: bool, samples: int = 4
) -> float:
    """Assert equivalence and dedup on every rank; returns the worst relative gradient error."""
    compared = {name for r in results for name in r["worst_excess"]}  # type: ignore[attr-defined]
    assert any(n.startswith("vision.") for n in compared), "no vision gradient was compared"
    for rank, result in enumerate(results):
        worst = result["worst_excess"]
        assert isinstance(worst, dict)
        assert result["restored"], f"rank {rank}: vision path or finalize func not restored"
        bad = {name: excess for name, excess in worst.items() if excess > ATOL}
        assert not bad, f"rank {rank}: gradients beyond {ATOL} + {RTOL}*max|g_ref|: {bad}"
    # Dedup: the world encodes each unique image once per mini-batch (with every TP peer when the
    # vision path is TP-sharded); the reference encodes every consumed piece on every rank.
    encoded = sum(int(r["encoded"]) for r in results)  # type: ignore[call-overload]
    references = sum(int(r["references"]) for r in results)  # type: ignore[call-overload]
    unique_per_step = [
        len({i.key for t in user.grpo_trajectories(s, samples) for i in t.multimodal})
        for s in range(STEPS)
    ]
    assert encoded == sum(unique_per_step) * (tensor_parallel if sharded else 1)
    assert references > encoded
    worst = max(float(r["worst_rel"]) for r in results)  # type: ignore[arg-type]
    print(f"worst relative gradient error: {worst:.2e}")
    return worst


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


def _example(rank: int, steps: int) -> list[dict[str, float]]:
    megatron_cpu.initialize_model_parallel(tensor_parallel=2)
    megatron_cpu.install_schedule_shim()
    try:
        return user.train(steps=steps)
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


@pytest.fixture(scope="module")
def world2() -> Iterator[World]:
    with World(2, timeout_s=240) as world:
        yield world


@pytest.fixture(scope="module")
def world4() -> Iterator[World]:
    with World(4, timeout_s=240) as world:
        yield world


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
VISION = pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "tp_sharded"])


@OVERLAP
@VISION
def test_tp2_wrapped_step_matches_unwrapped(world2: World, overlap: bool, sharded: bool) -> None:
    """TP=2: every encoder, projector and backbone gradient equals the re-encoding reference."""
    _check(world2.run(_equivalence, 2, overlap, sharded), 2, sharded)


@OVERLAP
@VISION
def test_dp2_tp2_wrapped_step_matches_unwrapped(
    world4: World, overlap: bool, sharded: bool
) -> None:
    """DP=2 x TP=2: same equivalence with encodings routed across DP (and TP-owned gradient slices)."""
    _check(world4.run(_equivalence, 2, overlap, sharded), 2, sharded)


VIT_SP = {"vision_transformer": True, "sequence_parallel": True}


@pytest.mark.slow
def test_tp2_sharded_vision_transformer_sequence_parallel(world2: World) -> None:
    """TP=2, sequence parallel: a TP-sharded ViT with q/k layernorm and SP-tagged norms and
    row-parallel biases gets megatron's TP reduction in finalize, so every gradient (those
    included) equals the unwrapped step's, and both TP ranks hold the same replicated gradients."""
    _check(world2.run(_equivalence, 2, False, True, 4, VIT_SP), 2, True)


@pytest.mark.slow
def test_dp2_tp2_sharded_vision_transformer_sequence_parallel(world4: World) -> None:
    """DP=2 x TP=2, sequence parallel, overlapped grad reduce: the same equivalence as at TP=2."""
    _check(world4.run(_equivalence, 2, True, True, 4, VIT_SP), 2, True)


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
        _check(world.run(_equivalence, 2, True, True, 4, VIT_SP), 2, True)


def test_example_trains_with_dedup(world2: World) -> None:
    """examples/megatron_wrap.py at TP=2: the loss falls and each unique image is encoded once per step."""
    history = world2.run(_example, 3)
    assert history[0] == history[1], "TP ranks must agree on the reduced figures"
    losses = [step["loss"] for step in history[0]]
    assert losses[0] > losses[1] > losses[2], losses
    unique = len({i.key for t in user.grpo_trajectories(0) for i in t.multimodal})
    assert all(step["encoded_units"] == unique for step in history[0])


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
