"""MoE routing replay on megatron-core (issue 33.3): stored routing -> packed micro-batches ->
``RoutingReplay`` -> megatron-core's ``RouterReplay``, against an unwrapped step that calls
``RouterReplay.set_replay_data`` itself.

Each layout runs a megatron-core MoE ``GPTModel`` (local spec, 8 experts, top-2, allgather
dispatcher) in a gloo world: the wrapped path reads the routing from a ``TrajectoryStore``
through the planner and THD packing (padding included) and replays it with
``RoutingReplay.replaying``; the reference builds the same micro-batches from the trajectories'
arrays and hands each router its rows itself. The stored routings are random (never what the
router would pick), so every check below fails without replay: every router's top-k equals the
stored experts for every token and layer, and losses and gradients equal the reference's.
CP2 runs an attention-free model (megatron's ``IdentityOp`` as self-attention: megatron-core's
local attention has no context parallelism without Transformer Engine), token-local but for the
MoE routing, against itself at CP1 on the whole sequences. PP2 also runs through a real
``Driver``, each stage's ring reading only its layers of the field.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist import World

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from knitkit.admission import build_controller
from knitkit.encoder_dedup import route_minibatch
from knitkit.integration.megatron import (
    DedupVLMStep,
    MegatronRank,
    block_causal_mask,
    megatron_batch,
    megatron_batches,
    stage_layers,
)
from knitkit.integration.megatron import cpu as megatron_cpu
from knitkit.integration.megatron.routing_replay import RoutingReplay
from knitkit.job import Driver, Output, Pass, RankSpec, broadcast_rank_spec
from knitkit.microbatch_iter import MicroBatchIterator, PackedMicroBatch
from knitkit.next_token import next_token_fields
from knitkit.storage import (
    EncoderTopology,
    MemoryBackend,
    MiniBatchPlan,
    PlannerConfig,
    Topology,
    Trajectory,
    TrajectoryStore,
    pack,
    plan_minibatch,
)
from knitkit.storage.planning import StageLayers, plan_encoder
from knitkit.types import TrajectoryMeta

WORLD_TIMEOUT_S = 120.0
"""Default limit of one job on this module's lent worlds (``world2``/``world4`` in tests/conftest.py)."""

LAYERS, EXPERTS, TOPK, VOCAB = 4, 8, 2, 64
LENGTHS = (9, 14, 6, 11, 7, 12)
FIELDS = ("tokens", "labels", "loss_mask", "routing")
PAD = 64
"""Tokens of every micro-batch the PP2 job feeds megatron (one length under pipelining)."""


def trajectories(seed: int = 0) -> list[Trajectory]:
    """Trajectories with random tokens and random (distinct per token) stored experts."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        routing = np.argsort(rng.random((n, LAYERS, EXPERTS)), axis=-1)[..., :TOPK]
        fields = {
            "tokens": rng.integers(1, VOCAB, n).astype(np.int32),
            "loss_mask": (np.arange(n) >= 3).astype(np.uint8),
            "routing": routing.astype(np.uint8),
        }
        out.append(Trajectory(f"t{i}", f"s{i // 2}", next_token_fields(fields)))
    return out


def _config(tp: int, pp: int, recompute: bool = False, cp: int = 1) -> Any:
    from megatron.core.transformer import TransformerConfig

    recomputed: dict[str, Any] = {}
    if recompute:  # every layer's forward runs again inside its backward
        recomputed = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    return TransformerConfig(
        **recomputed,
        num_layers=LAYERS,
        hidden_size=16,
        num_attention_heads=4,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=8,
        moe_token_dispatcher_type="allgather",  # alltoall needs CUDA streams
        moe_router_load_balancing_type="none",
        moe_enable_routing_replay=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=tp > 1,  # megatron refuses MoE training at TP > 1 without it
        use_cpu_initialization=True,
        add_bias_linear=False,
        bias_dropout_fusion=False,
        pipeline_dtype=torch.float32,
        variable_seq_lengths=False,  # allgather refuses it: micro-batches are padded to one length
        batch_p2p_comm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def _model(config: Any, attention: bool = True) -> torch.nn.Module:
    """A megatron-core MoE GPTModel (local spec, sequence-parallel norms), seeded; without
    ``attention`` every layer's self-attention (and its norm and bias-dropout-add) is megatron's
    ``IdentityOp``: the model is token-local but for the MoE layers' routing, so it runs under
    context parallelism on CPU (megatron-core's local attention has none without TE)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    torch.manual_seed(0)
    spec = megatron_cpu.moe_block_spec(EXPERTS)(LAYERS // config.pipeline_model_parallel_size)
    if not attention:
        layer = spec.layer_specs[0]
        identity = dataclasses.replace(
            layer.submodules,
            input_layernorm=IdentityOp,
            self_attention=IdentityOp,
            self_attn_bda=IdentityFuncOp,
        )
        spec.layer_specs = [dataclasses.replace(layer, submodules=identity)] * len(spec.layer_specs)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=64,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )


def _forward_step(
    data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    mask = batch["loss_mask"]

    def loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        value = (output.float() * mask).sum() / mask.sum().clamp(min=1)
        return value, {"loss": value.detach().clone()}

    return output, loss


def _observe(model: torch.nn.Module, seen: list[tuple[int, torch.Tensor]]) -> None:
    """Note every router's routing map (layer, [T_local, experts]) as the forward makes it."""
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():
        if isinstance(module, TopKRouter):
            layer = int(module.layer_number) - 1
            module.register_forward_hook(
                lambda m, args, out, layer=layer: seen.append((layer, out[1].detach().clone()))
            )


def _run(
    model: torch.nn.Module,
    step: Any,
    batches: Any,
    count: int = 0,
    forward_only: bool = False,
    seq_length: int = 0,
) -> list[float]:
    """Megatron's schedule over ``batches`` (a list, or an iterator of ``count`` micro-batches
    of ``seq_length`` tokens: read only by pipeline p2p, where they share one padded length)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if isinstance(batches, list):
        count, seq_length = len(batches), int(batches[0]["tokens"].shape[1])
        batches = iter(batches)
    losses = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=batches,
        model=[model],
        num_microbatches=count,
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=forward_only,
    )
    return [float(out["loss"]) for out in losses]


def _noting(
    taken: list[dict[str, Any]], data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module
) -> Any:
    """``_forward_step`` keeping a copy of each batch it takes (a prefetched micro-batch's
    views are reused once the ring comes round)."""
    batch = next(data_iterator)
    copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    params = batch["packed_seq_params"]
    real = torch.zeros(batch["tokens"].shape[1], dtype=torch.bool)
    starts, lengths = params.cu_seqlens_q_padded[:-1], params.cu_seqlens_q.diff()
    for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
        real[start : start + length] = True  # padding rows are not written back
    taken.append({**copy, "real": real})
    return _forward_step(iter([batch]), model)


def _forward_only(model: torch.nn.Module, step: Any, batches: Any, count: int = 0) -> list[float]:
    return _run(model, step, batches, count, forward_only=True)


def _record_then_misuse(rank: int) -> dict[str, Any]:
    """TP2: a forward-only pass records the routers' own choices; replaying them gives the same
    losses; then each misuse raises, naming the field and the rank."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    megatron_cpu.initialize_model_parallel(tensor_parallel=2)
    megatron_cpu.install_schedule_shim()
    megatron_cpu.install_moe_shim()
    try:
        batches = _batches(1, 2)
        model = _model(_config(2, 1))
        replay = RoutingReplay(model, record_forward_only=True)
        plain = _forward_only(model, _forward_step, batches)
        recorded = _forward_only(model, replay.wrap(_forward_step, forward_only=True), batches)
        replay.clear()
        replayed_batches = [
            {**batch, "routing": rows[None]}
            for batch, rows in zip(batches, replay.gathered(), strict=True)
        ]
        replay.record_forward_only = False
        try:
            replayed = _forward_only(
                model, replay.wrap(_forward_step, forward_only=True), replayed_batches
            )
        finally:
            replay.clear()
        errors = {}
        try:  # a plan whose stage split is not this chunk's layers
            replay.replaying(_forward_step, layers=(1, 3))
        except ValueError as error:
            errors["stage"] = str(error)
        bad = {
            "layers": {**batches[0], "routing": batches[0]["routing"][:, :, :3]},
            "missing": {k: v for k, v in batches[0].items() if k != "routing"},
            "range": {**batches[0], "routing": batches[0]["routing"] + EXPERTS},
        }
        for name, batch in bad.items():
            try:
                _forward_only(model, replay.replaying(_forward_step), [batch])
            except ValueError as error:
                errors[name] = str(error)
            finally:
                replay.clear()
        return {
            "plain": plain,
            "recorded": recorded,
            "replayed": replayed,
            "errors": errors,
            "metrics": replay.metrics(),
        }
    finally:
        RouterReplay.clear_global_router_replay_instances()
        megatron_cpu.destroy_model_parallel()


def _batches(dp: int, tp: int, plan: MiniBatchPlan | None = None) -> list[dict[str, Any]]:
    """This rank's micro-batches of ``plan`` (default: one planned here), read from a store of
    ``trajectories()`` through THD packing with every layer of ``routing``, as ``_padded``
    megatron batches of one length."""
    from megatron.core import parallel_state as ps

    data = trajectories()
    store = TrajectoryStore(MemoryBackend())
    for trajectory in data:
        store.write(trajectory)
    ids = [t.trajectory_id for t in data]
    if plan is None:
        plan = store.register(
            plan_minibatch(
                store.metas(ids),
                Topology(dp=dp, cp=1, tp=tp, sequence_parallel=tp > 1),
                PlannerConfig(token_fields=FIELDS, scalar_fields=(), min_micro_batches=2),
            )
        )
    consumer = plan.consumer(ps.get_data_parallel_rank(), 0)
    schema = store.schema(ids[0])
    packed = [PackedMicroBatch(*pack(mb, schema, store.read_into)) for mb in consumer.micro_batches]
    length = max(mb.num_tokens for c in plan.consumers for mb in c.micro_batches)
    to_batch = functools.partial(_padded, length=PAD if plan.stage_layers else length)
    with MicroBatchIterator(packed) as iterator:
        return list(megatron_batches(iterator, to_batch))


def _padded(micro_batch: Any, length: int) -> dict[str, Any]:
    """A megatron batch plus ``routing`` ``[1, T, layers, topk]``, padded to ``length`` tokens
    (megatron's allgather dispatcher refuses ``variable_seq_lengths``, which PP needs for
    varying lengths); new tensors, not views of a ring slot."""
    batch = megatron_batch(micro_batch)
    batch["routing"] = micro_batch["routing"][None]
    padded = micro_batch["cu_seqlens_padded"]
    pad = length - int(padded[-1])
    for key in ("tokens", "labels", "loss_mask", "position_ids", "routing"):
        value = batch[key]
        tail = torch.zeros((1, pad, *value.shape[2:]), dtype=value.dtype)
        batch[key] = torch.cat([value, tail], dim=1)
    batch["position_ids"][0, length - pad :] = torch.arange(pad)
    lengths = torch.cat([padded[1:] - padded[:-1], torch.tensor([pad])])
    batch["attention_mask"] = block_causal_mask(lengths[lengths > 0])
    return batch


def _reference(
    model: torch.nn.Module,
    routers: list[Any],
    batches: list[dict[str, Any]],
    stored: Callable[[Mapping[str, Any], int], torch.Tensor],
    forward_only: bool = False,
    step: Any = _forward_step,
) -> list[float]:
    """The unwrapped step, as Megatron-LM's users run it: ``RouterReplay.set_replay_data`` with
    every local layer's rows, replay forward, then the recompute pops in order. ``routers``:
    ``model``'s RouterReplay instances, which set_replay_data addresses for the call (it
    addresses every router the process built)."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    layers = sorted(int(m.layer_number) - 1 for m in model.modules() if isinstance(m, TopKRouter))
    queue = iter(batches)

    def reference_step(data_iterator: Any, chunk: torch.nn.Module) -> Any:
        batch = next(queue)
        RouterReplay.set_replay_data([stored(batch, layer) for layer in layers])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        out = step(iter([batch]), chunk)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return out

    others = list(RouterReplay.global_router_replay_instances)
    RouterReplay.global_router_replay_instances[:] = routers
    try:
        return _run(model, reference_step, batches, forward_only=forward_only)
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        RouterReplay.global_router_replay_instances[:] = others


def _layout(rank: int, dp: int, tp: int, pp: int, recompute: bool) -> dict[str, Any]:
    """One layout on every rank: the wrapped replay, then the reference; what each saw."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    megatron_cpu.initialize_model_parallel(tensor_parallel=tp, pipeline_parallel=pp)
    megatron_cpu.install_pipeline_shim()
    megatron_cpu.install_moe_shim()
    megatron_cpu.install_recompute_shim()
    try:
        batches = _batches(dp, tp)
        sp_rank, sp = (ps.get_tensor_model_parallel_rank(), tp) if tp > 1 else (0, 1)

        def stored(batch: Mapping[str, Any], layer: int) -> torch.Tensor:
            rows = batch["routing"][0]
            local = rows.shape[0] // sp
            return rows[sp_rank * local : (sp_rank + 1) * local, layer].long()

        RouterReplay.clear_global_router_replay_instances()
        reference = _model(_config(tp, pp, recompute))
        ref_routers = list(RouterReplay.global_router_replay_instances)
        ref_seen: list[tuple[int, torch.Tensor]] = []
        _observe(reference, ref_seen)
        ref_losses = _reference(reference, ref_routers, batches, stored)
        ref_grads = {
            n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None
        }

        model = _model(_config(tp, pp, recompute))
        seen: list[tuple[int, torch.Tensor]] = []
        _observe(model, seen)
        replay = RoutingReplay(model)
        try:
            losses = _run(model, replay.replaying(_forward_step), batches)
        finally:
            replay.clear()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        layers = replay.layers
        wanted = [(layer, stored(b, layer)) for b in batches for layer in layers]
        return {
            "calls": 2 if recompute else 1,
            "wanted": wanted,
            "seen": seen,
            "ref_seen": ref_seen,
            "losses": losses,
            "ref_losses": ref_losses,
            "grads": grads,
            "ref_grads": ref_grads,
            "leftover": [len(r.replay_backward_list) for _, r in replay._routers],
        }
    finally:
        RouterReplay.clear_global_router_replay_instances()
        megatron_cpu.destroy_model_parallel()


def _check(results: list[dict[str, Any]]) -> None:
    """Every router call (the recomputed forwards included) routed a micro-batch's stored
    experts, as often as the schedule runs it; the reference routed the same, call by call."""
    for rank, got in enumerate(results):
        assert got["wanted"] and len(got["seen"]) == got["calls"] * len(got["wanted"]), rank
        for layer in {layer for layer, _ in got["wanted"]}:
            maps = [m for seen_layer, m in got["seen"] if seen_layer == layer]
            want = [
                torch.zeros((rows.shape[0], EXPERTS), dtype=torch.bool).scatter(1, rows, True)
                for wanted_layer, rows in got["wanted"]
                if wanted_layer == layer
            ]
            if got["calls"] == 1:  # the order of the micro-batches
                assert all(map(torch.equal, maps, want)), f"rank {rank} layer {layer}"
            else:  # 1F1B interleaves forwards and recomputes: compare as multisets
                key = lambda m: m.numpy().tobytes()  # noqa: E731
                assert sorted(map(key, maps)) == sorted(key(m) for m in want * got["calls"]), (
                    f"rank {rank} layer {layer}: replayed experts differ from the stored ones"
                )
        for (layer, a), (_, b) in zip(got["seen"], got["ref_seen"], strict=True):
            assert torch.equal(a, b), f"rank {rank} layer {layer}: reference routed differently"
        np.testing.assert_allclose(got["losses"], got["ref_losses"], rtol=1e-6, atol=1e-7)
        assert got["grads"].keys() == got["ref_grads"].keys()
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, got["ref_grads"][name], rtol=1e-5, atol=1e-6)
        assert got["leftover"] == [0] * len(got["leftover"]), "replay rows left after the step"


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_replayed_topk_equals_the_stored_routing(world2: World, tp: int, pp: int) -> None:
    """TP2 (sequence parallel: each TP rank replays its half of the packed tokens) and PP2
    (each stage its own layers, 1F1B), both with full activation recompute (each layer's
    forward reruns in its backward and must replay the same micro-batch's rows): replayed
    experts == stored for every token, layer and call; losses and gradients == the unwrapped
    step's that calls RouterReplay.set_replay_data itself."""
    _check(world2.run(_layout, 1, tp, pp, True, timeout_s=300))


def test_recorded_routing_replays_and_misuse_names_field_and_rank(world2: World) -> None:
    """A forward-only pass records (the rollout stand-in); replaying the recording gives the
    same losses. A routing with the wrong layer count, a micro-batch without routing, an expert
    id past num_experts and a plan's stage layers that are not the model chunk's each raise a
    ValueError naming 'routing' and the rank."""
    for rank, got in enumerate(world2.run(_record_then_misuse, timeout_s=300)):
        assert got["recorded"] == got["plain"] and got["replayed"] == got["plain"]
        assert set(got["errors"]) == {"layers", "missing", "range", "stage"}, got["errors"]
        for message in got["errors"].values():
            assert f"rank {rank}:" in message and "'routing'" in message, message
        assert "[tokens, 4, topk]" in got["errors"]["layers"]
        assert "outside [0, 8)" in got["errors"]["range"]
        assert "carries layers [1, 3]" in got["errors"]["stage"]
        assert "routes in layers [0, 1, 2, 3]" in got["errors"]["stage"]
        assert got["metrics"]["knitkit/routing/bytes_read_ratio"] == 1.0
        assert got["metrics"]["knitkit/routing/delivered_ratio"] == 2.0  # its half of the tokens


RANK_PASSES = (
    Pass(
        "rollout",
        reads=("tokens", "labels", "loss_mask"),
        writes=(Output("routing", "uint8", (LAYERS, TOPK)),),
        forward_only=True,
    ),
    Pass("train", reads=("tokens", "labels", "loss_mask", "routing")),
)


def _rank_job(rank: int, spec_json: str) -> list[dict[str, Any]]:
    """TP2 (sequence parallel) through a real Driver and ``MegatronRank(routing=...)``: the
    rollout pass records each micro-batch's routing and writes it back; the routers then drift
    (as the policy does between rollout and training); the train pass replays what was stored.
    Per train micro-batch: the recorded rows, the routing maps the routers made, and how many
    tokens the drifted routers would have routed differently on their own."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    megatron_cpu.initialize_model_parallel(tensor_parallel=2)
    megatron_cpu.install_schedule_shim()
    megatron_cpu.install_moe_shim()
    try:
        spec = broadcast_rank_spec(RankSpec.from_json(spec_json) if rank == 0 else None)
        model = _model(_config(2, 1))
        seen: list[tuple[int, torch.Tensor, int]] = []

        def observe(module: Any, args: Any, out: Any) -> None:
            natural = torch.topk(module.gating(args[0]).reshape(-1, EXPERTS), TOPK).indices
            own = torch.zeros_like(out[1]).scatter(1, natural, True)
            changed = int((own != out[1]).any(dim=1).sum())
            seen.append((int(module.layer_number) - 1, out[1].detach().clone(), changed))

        replay = RoutingReplay(model)
        recorded: dict[tuple[str, int], torch.Tensor] = {}
        out: list[dict[str, Any]] = []
        to_batch = functools.partial(megatron_batch, cp_size=1, attention_mask=True)
        with MegatronRank.from_parallel_state(
            spec, to_batch=to_batch, sequence_parallel=True, routing=replay
        ) as mrank:
            for work in mrank.passes():
                with work:
                    if not work.forward_only:
                        hooks = [
                            m.register_forward_hook(observe)
                            for m in model.modules()
                            if isinstance(m, TopKRouter)
                        ]
                    batches: list[dict[str, Any]] = []
                    step = work.forward_step(functools.partial(_noting, batches))
                    if work.forward_only:
                        _forward_only(model, step, work.data_iterator(), work.num_micro_batches)
                        for i, rows in enumerate(replay.gathered()):
                            recorded[(work.minibatch_id, i)] = rows
                        work.write_back_routing()
                        with torch.no_grad():  # the policy moves on before training
                            for m in model.modules():
                                if isinstance(m, TopKRouter):
                                    m.weight.add_(torch.randn_like(m.weight))
                        continue
                    seen.clear()
                    _run(model, step, work.data_iterator(), work.num_micro_batches)
                    for h in hooks:
                        h.remove()
                    for i, batch in enumerate(batches):
                        maps = seen[i * LAYERS : (i + 1) * LAYERS]
                        out.append(
                            {
                                "recorded": recorded[(work.minibatch_id, i)],
                                "stored": batch["routing"][0].clone(),
                                "real": batch["real"],
                                "maps": [(layer, m) for layer, m, _ in maps],
                                "changed": sum(c for _, _, c in maps),
                            }
                        )
                    assert all(not r.replay_backward_list for _, r in replay._routers)
        return out
    finally:
        RouterReplay.clear_global_router_replay_instances()
        megatron_cpu.destroy_model_parallel()


def test_megatron_rank_records_then_replays_through_the_driver(world2: World) -> None:
    """A real Driver and MegatronRank(routing=...) at TP2: the forward-only pass's recorded
    routing reaches the store and the train pass's batches bit-exactly; every router replays
    it (each TP rank its half of the tokens) though the drifted routers would choose otherwise."""
    data = [
        dataclasses.replace(
            t, token_fields={k: v for k, v in t.token_fields.items() if k != "routing"}
        )
        for t in trajectories(seed=2)
    ]
    controller = build_controller(
        "streaming", train_batch_size=len(data), num_minibatches=2, sources=["s"]
    )
    config = Driver.Config(
        passes=RANK_PASSES,
        topology=Topology(dp=1, cp=1, tp=2, sequence_parallel=True),
        planner=PlannerConfig(min_micro_batches=2),
        slot_bytes=1 << 20,
        schedule_slot_bytes=1 << 20,
        write_back_slot_bytes=1 << 18,
    )
    with config.build(admission=controller) as driver:
        for trajectory in data:
            driver.write(dataclasses.replace(trajectory, source="s"))
        driver.finish()
        results = world2.run(_rank_job, driver.rank_spec().to_json(), timeout_s=300)
        driver.drain(120)
    for rank, micro_batches in enumerate(results):
        assert micro_batches and sum(m["changed"] for m in micro_batches) > 0, rank
        for got in micro_batches:
            tokens = got["stored"].shape[0]
            real = got["real"]
            assert torch.equal(got["recorded"][real], got["stored"][real]), "store round trip"
            half = tokens // 2
            for layer, routing_map in got["maps"]:
                rows = got["stored"][rank * half : (rank + 1) * half, layer].long()
                want = torch.zeros_like(routing_map).scatter(1, rows, True)
                assert torch.equal(routing_map, want), (rank, layer)


def _example(rank: int, spec_json: str) -> list[dict[str, float]]:
    """``grpo_megatron.py --moe``'s passes on this world's ranks (TP2, sequence parallel)."""
    from grpo.moe import MoEConfig, train
    from megatron.core.transformer.moe.router_replay import RouterReplay

    megatron_cpu.initialize_model_parallel(tensor_parallel=2, seed=1234)
    megatron_cpu.install_schedule_shim()
    try:
        spec = broadcast_rank_spec(RankSpec.from_json(spec_json) if rank == 0 else None)
        return train(spec, MoEConfig(steps=1))
    finally:
        RouterReplay.clear_global_router_replay_instances()
        megatron_cpu.destroy_model_parallel()


def test_moe_grpo_example_trains_with_the_rollout_routing(world2: World) -> None:
    """The example (issue 33.4): the first mini-batch trains with the weights that rolled it
    out, so replay changes nothing; the second replays the rollout's routing although the
    policy's routers moved with the first update (replay overrides some of their choices)."""
    from grpo.moe import MoEConfig, start_driver

    topology = Topology(dp=1, cp=1, tp=2, sequence_parallel=True)
    with start_driver(MoEConfig(steps=1), topology) as driver:
        results = world2.run(_example, driver.rank_spec().to_json(), timeout_s=300)
        driver.drain(120)
    for history in results:
        assert len(history) == 2 and all(np.isfinite(h["loss"]) for h in history)
        assert history[0]["overridden"] == 0.0 and history[1]["overridden"] > 0.0, history


def _cp_forward_step(
    data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    """The loss over this CP rank's tokens divided by the micro-batch's loss tokens on every CP
    rank (megatron's schedule scales it by the CP size; DDP would average the gradients over CP)."""
    from megatron.core import parallel_state as ps

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"]
    count = mask.sum()
    torch.distributed.all_reduce(count, group=ps.get_context_parallel_group())

    def loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        value = (output.float() * mask).sum() / count.clamp(min=1)
        return value, {"loss": value.detach().clone()}

    return output, loss


def _context_parallel(rank: int) -> dict[str, Any]:
    """CP2 fed by knitkit (each CP rank packs its own chunks of every sequence, its tokens'
    routing read from the store) against the same model at CP1 on the whole sequences, fed every
    layer through RouterReplay.set_replay_data; the model is attention-free (``_model``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    data = trajectories()
    store = TrajectoryStore(MemoryBackend())
    for trajectory in data:
        store.write(trajectory)
    ids = [t.trajectory_id for t in data]
    schema = store.schema(ids[0])
    plan = store.register(
        plan_minibatch(
            store.metas(ids),
            Topology(dp=1, cp=2),
            PlannerConfig(token_fields=FIELDS, scalar_fields=(), min_micro_batches=2),
        )
    )

    def batches(micro_batches: Any, cp: int) -> list[dict[str, Any]]:
        packed = [PackedMicroBatch(*pack(mb, schema, store.read_into)) for mb in micro_batches]

        def to_batch(mb: Any) -> dict[str, Any]:  # a copy: the staging slots are reused
            return {**megatron_batch(mb, cp_size=cp), "routing": mb["routing"][None].clone()}

        with MicroBatchIterator(packed) as iterator:
            return list(megatron_batches(iterator, to_batch))

    megatron_cpu.initialize_model_parallel(context_parallel=2)
    megatron_cpu.install_schedule_shim()
    megatron_cpu.install_moe_shim()
    try:
        cp_rank = ps.get_context_parallel_rank()
        mine = plan.consumer(0, cp_rank).micro_batches
        local = batches(mine, 2)
        RouterReplay.clear_global_router_replay_instances()
        model = _model(_config(1, 1, cp=2), attention=False)
        model.vision = torch.nn.Identity()  # DedupVLMStep's vision path: this model has no images
        model.config.finalize_model_grads_func = lambda *args, **kwargs: None  # no DDP here
        seen: list[tuple[int, torch.Tensor]] = []
        _observe(model, seen)
        replay = RoutingReplay(model)
        encoder = plan_encoder([], EncoderTopology("vision", dp=2))
        consumers = {r: plan.consumer(0, r) for r in range(2)}
        route = route_minibatch(consumers, encoder.ranks, world_size=2).for_rank(cp_rank)
        step = DedupVLMStep(model, routing=replay)  # on its own: no MegatronRank
        outputs = step.run(
            forward_step_func=_cp_forward_step,
            data_iterator=iter(local),
            route=route,
            encode_fn=lambda keys: torch.empty(0, 16),
            num_microbatches=len(local),
            seq_length=0,
            micro_batch_size=1,
        )
        losses = torch.tensor([float(o["loss"]) for o in outputs])  # type: ignore[index]
        assert all(
            not r.replay_backward_list and r.target_topk_idx is None for _, r in replay._routers
        )
        group = ps.get_context_parallel_group()
        torch.distributed.all_reduce(losses, group=group)  # the CP ranks' shares of each loss
        grads = {}
        for name, param in model.named_parameters():
            if param.grad is not None:  # DDP's average over DP x CP
                torch.distributed.all_reduce(param.grad, group=group)
                grads[name] = param.grad / 2
        # where each of this rank's packed rows sits in the whole sequences' packing
        where = []
        for mb in mine:
            starts = np.cumsum([0] + [s.padded_length for s in mb.sequences])
            where.append(
                torch.tensor(
                    np.concatenate(
                        [
                            np.arange(start, stop) + offset
                            for s, offset in zip(mb.sequences, starts.tolist(), strict=False)
                            for start, stop in s.chunks
                        ]
                    )
                )
            )
        wanted = [(i, b["routing"][0, :, i].long()) for b in local for i in replay.layers]
    finally:
        RouterReplay.clear_global_router_replay_instances()
        megatron_cpu.destroy_model_parallel()

    megatron_cpu.initialize_model_parallel()  # CP1: the reference on the whole sequences
    try:
        whole = [
            dataclasses.replace(
                mb,
                sequences=tuple(
                    dataclasses.replace(s, chunks=((0, s.padded_length),)) for s in mb.sequences
                ),
            )
            for mb in mine
        ]
        full = batches(whole, 1)
        reference = _model(_config(1, 1), attention=False)
        ref_routers = list(RouterReplay.global_router_replay_instances)
        ref_seen: list[tuple[int, torch.Tensor]] = []
        _observe(reference, ref_seen)
        stored = lambda b, layer: b["routing"][0, :, layer].long()  # noqa: E731
        ref_losses = _reference(reference, ref_routers, full, stored, step=_cp_forward_step)
        ref_grads = {
            n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None
        }
        # the reference's routing maps at this rank's rows
        ref_local = [(layer, m[where[i // LAYERS]]) for i, (layer, m) in enumerate(ref_seen)]
        return {
            "calls": 1,
            "wanted": wanted,
            "seen": seen,
            "ref_seen": ref_local,
            "losses": losses.tolist(),
            "ref_losses": ref_losses,
            "grads": grads,
            "ref_grads": ref_grads,
            "leftover": [len(r.replay_backward_list) for _, r in replay._routers],
        }
    finally:
        RouterReplay.clear_global_router_replay_instances()
        megatron_cpu.destroy_model_parallel()


def test_replay_at_cp2(world2: World) -> None:
    """CP2 (DP x CP = 2) through ``DedupVLMStep(routing=...)`` on its own: each CP rank replays
    its own chunks' routing as knitkit packs them (Megatron's 2*cp load-balanced chunks, padding
    included) and the step clears every router after; replayed experts == stored for every token
    and layer, == the reference's at the same tokens of the whole sequences at CP1, and the CP
    ranks' losses and gradients (summed, averaged as DDP does) == the reference's."""
    _check(world2.run(_context_parallel, timeout_s=300))


PP_PASSES = (Pass("score", reads=FIELDS, forward_only=True), Pass("train", reads=FIELDS))


def _stage_job(rank: int, spec_json: str) -> dict[str, Any]:
    """PP2 (1F1B, full recompute) through a real Driver and ``MegatronRank(routing=...)``: each
    stage's ring carries its own layers of ``routing`` only. The forward-only pass runs through
    ``DedupVLMStep(routing=...)`` on its own, the train pass through ``work.forward_step``; each
    against the reference fed every layer of the same plan's micro-batches from a local store."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    megatron_cpu.initialize_model_parallel(pipeline_parallel=2)
    megatron_cpu.install_pipeline_shim()
    megatron_cpu.install_moe_shim()
    megatron_cpu.install_recompute_shim()
    try:
        spec = broadcast_rank_spec(RankSpec.from_json(spec_json) if rank == 0 else None)
        RouterReplay.clear_global_router_replay_instances()
        reference = _model(_config(1, 2, recompute=True))
        ref_routers = list(RouterReplay.global_router_replay_instances)
        model = _model(_config(1, 2, recompute=True))
        model.vision = torch.nn.Identity()  # DedupVLMStep's vision path: this model has no images
        ref_seen: list[tuple[int, torch.Tensor]] = []
        seen: list[tuple[int, torch.Tensor]] = []
        _observe(reference, ref_seen)
        _observe(model, seen)
        replay = RoutingReplay(model)
        step = DedupVLMStep(model, routing=replay)
        to_batch = functools.partial(_padded, length=PAD)
        out: dict[str, Any] = {"passes": []}
        with MegatronRank.from_parallel_state(spec, to_batch=to_batch, routing=replay) as mrank:
            for work in mrank.passes():
                with work:
                    full = _batches(1, 1, work.plan)  # every layer, read here from the trajectories
                    seen.clear()
                    ref_seen.clear()
                    count = work.num_micro_batches
                    if work.forward_only:
                        encoder = plan_encoder([], EncoderTopology("vision", dp=1))
                        routes = route_minibatch(
                            {0: work.work.consumer}, encoder.ranks, world_size=1
                        )
                        losses = step.run(
                            forward_step_func=_forward_step,
                            data_iterator=work.data_iterator(),
                            route=routes.for_rank(0),
                            encode_fn=lambda keys: torch.empty(0, 16),
                            num_microbatches=count,
                            seq_length=PAD,
                            micro_batch_size=1,
                            forward_only=True,
                        )
                        losses = [float(o["loss"]) for o in losses]  # type: ignore[index]
                    else:
                        step_func = work.forward_step(_forward_step)
                        losses = _run(model, step_func, work.data_iterator(), count, seq_length=PAD)
                    stored = lambda b, layer: b["routing"][0, :, layer].long()  # noqa: E731
                    ref_losses = _reference(reference, ref_routers, full, stored, work.forward_only)
                    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
                    ref_grads = {
                        n: p.grad for n, p in reference.named_parameters() if p.grad is not None
                    }
                    out["passes"].append(
                        {
                            "calls": 1 if work.forward_only else 2,  # recompute reruns forwards
                            "wanted": [(i, stored(b, i)) for b in full for i in replay.layers],
                            "seen": list(seen),
                            "ref_seen": list(ref_seen),
                            "losses": losses,
                            "ref_losses": ref_losses,
                            "grads": {n: g.clone() for n, g in grads.items()},
                            "ref_grads": {n: g.clone() for n, g in ref_grads.items()},
                            "leftover": [len(r.replay_backward_list) for _, r in replay._routers],
                            "stage_layers": work.stage_layers,
                        }
                    )
            out["metrics"] = {**mrank.metrics(), **step.metrics()}
        out["layers"] = replay.layers
        return out
    finally:
        RouterReplay.clear_global_router_replay_instances()
        megatron_cpu.destroy_model_parallel()


def test_pipeline_stages_read_only_their_layers(world2: World) -> None:
    """PP2 through a real Driver: one ring per stage, each reading its tokens x its own layers of
    ``routing`` from the store (a 2-D read: no rank reads the whole field), then replayed by
    DedupVLMStep(routing=...) on its own (forward-only pass) and by MegatronRank's forward step
    (train pass): replayed experts == stored for every token and layer (recomputes included),
    losses and gradients == the reference fed every layer through RouterReplay.set_replay_data."""
    data = trajectories()
    controller = build_controller(
        "streaming", train_batch_size=len(data), num_minibatches=1, sources=["s"]
    )
    split = stage_layers(_config(1, 2))
    assert split.ranges == ((0, 2), (2, 4))  # megatron-core's even split
    config = Driver.Config(
        passes=PP_PASSES,
        topology=Topology(dp=1),
        pipeline=2,
        planner=PlannerConfig(min_micro_batches=2, stage_layers=split),
        slot_bytes=1 << 20,
        schedule_slot_bytes=1 << 20,
        write_back_slot_bytes=1 << 18,
    )
    with config.build(admission=controller) as driver:
        for trajectory in data:
            driver.write(dataclasses.replace(trajectory, source="s"))
        driver.finish()
        spec = driver.rank_spec()
        assert set(spec.rings) == {"backbone/dp0/cp0/pp0", "backbone/dp0/cp0/pp1"}
        results = world2.run(_stage_job, spec.to_json(), timeout_s=300)
        driver.drain(120)
        pooled = driver.metrics()["knitkit/delivery/reorganizer_bytes_read"]
    _check([p for got in results for p in got["passes"]])
    tokens = sum(LENGTHS)
    others = sum(t.token_fields[f].nbytes for t in data for f in FIELDS if f != "routing")
    for stage, got in enumerate(results):
        assert got["layers"] == tuple(range(*split.ranges[stage]))
        assert [p["stage_layers"] for p in got["passes"]] == [split.ranges[stage]] * 2
        routing = tokens * 2 * TOPK  # its tokens x its 2 layers x top-k, uint8
        metrics = got["metrics"]
        assert metrics["knitkit/delivery/producer_bytes_read"] == len(PP_PASSES) * (
            others + routing
        ), stage
        assert metrics["knitkit/routing/delivered_ratio"] == 1.0  # its layers only, no SP
        assert metrics["knitkit/routing/bytes_read"] == metrics["knitkit/routing/bytes_delivered"]
    full = tokens * LAYERS * TOPK  # the two stages together read the field once per pass
    assert pooled == len(PP_PASSES) * (2 * others + full)


def test_stage_layers_follow_megatron_core_and_misfits_are_refused() -> None:
    """``stage_layers`` is megatron-core's split of the layers (even, and with an uneven first
    stage); a split with a gap, and a split over another number of stages than the job's
    pipeline (at the Driver, and when a plan is served), are refused naming both."""
    from megatron.core.transformer import TransformerConfig

    assert stage_layers(_config(1, 2)).ranges == ((0, 2), (2, 4))
    uneven = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=16,
        num_attention_heads=4,
        pipeline_model_parallel_size=2,
        num_layers_in_first_pipeline_stage=1,
        pipeline_dtype=torch.float32,
    )
    assert stage_layers(uneven).ranges == ((0, 1), (1, 4))
    with pytest.raises(ValueError, match=r"stage 1's layers \(3, 4\) must be"):
        StageLayers(((0, 2), (3, 4)), ("routing",))
    split = StageLayers(((0, 1), (1, 2), (2, 4)), ("routing",))
    metas = [
        TrajectoryMeta("t", "s", "a", rollout_step=0, num_tokens=4, min_version=0, max_version=0)
    ]
    plan = plan_minibatch(metas, Topology(dp=1), PlannerConfig(stage_layers=split))
    with pytest.raises(ValueError, match=r"over 3 pipeline stages .* the job runs 2"):
        plan.stage_consumers(2)
    config = Driver.Config(
        passes=(Pass("train", reads=FIELDS),),
        topology=Topology(dp=1),
        pipeline=2,
        planner=PlannerConfig(stage_layers=split),
    )
    controller = build_controller("streaming", train_batch_size=1, num_minibatches=1, sources=["s"])
    with pytest.raises(ValueError, match="over 3 stages; the job has pipeline=2"):
        config.build(admission=controller)


def test_replay_at_dp2_tp2(world4: World) -> None:
    """DP2 x TP2: each DP rank replays its own micro-batches' routing, each TP rank its half."""
    _check(world4.run(_layout, 2, 2, 1, False, timeout_s=300))
