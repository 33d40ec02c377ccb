"""Hands each packed micro-batch's stored routing to megatron-core's ``RouterReplay`` (R3 on the trainer)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from knitkit.integration.megatron.routing import ROUTING_FIELD, routing_dtype
from knitkit.types import SeqRange

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router_replay import RouterReplay

ForwardStep = Callable[[Iterator[Any], torch.nn.Module], tuple[torch.Tensor, Callable[..., Any]]]
"""Megatron's forward step: ``(data_iterator, model) -> (output, loss_func)``."""

# NOTE [ Routing replay in the schedule ]: megatron-core 0.16.1's RouterReplay keeps, per MoE
# router, a target (REPLAY_FORWARD reads it) and a FIFO (REPLAY_BACKWARD pops it: the forward
# that activation recompute reruns inside the backward). Megatron runs micro-batches in an
# order the data iterator does not see (1F1B runs warm-up forwards before the first backward),
# so the hand-off is tied to the forward step itself:
# - when the forward step takes its micro-batch (next(data_iterator)), this stage's rows of its
#   routing become every local router's target and join its FIFO, action REPLAY_FORWARD;
# - once the forward step returns (the model's forward ran), the action becomes
#   REPLAY_BACKWARD, so a recompute inside that micro-batch's backward pops its own rows: 1F1B
#   runs backwards in forward order, so the FIFO order is the forward order. Without recompute
#   nothing pops; the rows are dropped at once instead of piling up over the mini-batch;
# - after the schedule (the last backward), every router is cleared: no stale target can route
#   the next pass, whatever raised in between.
# The rows are the micro-batch's packed THD order on this rank: CP-local tokens as the ring
# delivers them, and under sequence parallelism this TP rank's contiguous 1/tp of them (the
# router runs after megatron's scatter to the sequence-parallel region). Each router takes the
# row of its own decoder layer (layer_number - 1): the stored layer axis is SGLang's, one row per
# hidden layer. Only this model's routers are touched (a reference model in the same process
# keeps its own), unlike RouterReplay.set_replay_data, which addresses every router the process
# ever built. Under pipeline parallelism a stage's ring carries only its own layers of the field
# (NOTE [ One ring per pipeline stage ] in knitkit/storage/planning/plan.py): router i then takes
# column i; a routing with every layer (a hand-fed batch) is read at layer_number - 1.


@dataclass(slots=True)
class RoutingReplay:
    """Replays (or records) MoE routing for one model chunk through megatron-core's ``RouterReplay``.

    Build it once per model (``moe_enable_routing_replay=True``) after the model exists; wrap the
    forward step of each pass with ``replaying`` (train and log-prob passes of R3) or
    ``recording`` (a rollout stand-in); ``clear()`` after the schedule (``DedupVLMStep`` does it
    when given ``routing=``). See NOTE [ Routing replay in the schedule ].
    """

    model: torch.nn.Module
    """The model chunk handed to the schedule (DDP-wrapped or not)."""
    num_experts: int | None = None
    """Routed experts per layer; defaults to the model config's ``num_moe_experts``."""
    key: str = ROUTING_FIELD
    """The batch key holding the micro-batch's routing ``[1, T, layers, topk]`` or ``[T, ...]``."""
    record_forward_only: bool = False
    """``wrap`` records instead of replaying in forward-only passes (a rollout stand-in)."""
    recorded: list[torch.Tensor] = field(default_factory=list, init=False)
    """``recording``: each micro-batch's routing ``[T_local, stage layers, topk]``, in order."""
    _routers: list[tuple[int, RouterReplay]] = field(default_factory=list, init=False)
    _num_layers: int = field(default=0, init=False)
    _recompute: bool = field(default=False, init=False)
    _sp: tuple[int, int] = field(default=(0, 1), init=False)
    _bytes: dict[str, int] = field(default_factory=lambda: {"delivered": 0, "read": 0}, init=False)

    def __post_init__(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.utils import get_model_config

        config = get_model_config(self.model)
        if not config.moe_enable_routing_replay:
            raise ValueError(
                f"rank {_rank()}: the model was built without routing replay; build it with "
                "TransformerConfig(moe_enable_routing_replay=True)"
            )
        routers = [
            (int(m.layer_number) - 1, m.router_replay)
            for m in self.model.modules()
            if isinstance(m, TopKRouter) and m.router_replay is not None
        ]
        self._routers = sorted(routers, key=lambda pair: pair[0])
        self._num_layers = int(config.num_layers)
        self._recompute = config.recompute_granularity is not None
        if self.num_experts is None:
            self.num_experts = int(config.num_moe_experts or 0)
        if config.sequence_parallel:
            self._sp = (
                ps.get_tensor_model_parallel_rank(),
                ps.get_tensor_model_parallel_world_size(),
            )

    @property
    def layers(self) -> tuple[int, ...]:
        """The decoder layers (0-based, rows of the stored layer axis) this chunk routes in."""
        return tuple(layer for layer, _ in self._routers)

    def replaying(
        self, forward_step: ForwardStep, *, layers: SeqRange | None = None
    ) -> ForwardStep:
        """``forward_step`` replaying each micro-batch's stored routing (NOTE [ Routing replay in
        the schedule ]). ``layers``: the decoder layers the micro-batches' routing carries (this
        pipeline stage's, ``plan.stage_layers.ranges[stage]``); ``ValueError`` naming the rank
        unless they are exactly the layers this chunk routes in."""
        if layers is not None and tuple(range(*layers)) != self.layers:
            raise ValueError(
                f"rank {_rank()}: field {self.key!r} carries layers {list(layers)} (this stage's "
                f"in the plan's StageLayers), but this model chunk routes in layers "
                f"{list(self.layers)}; plan with PlannerConfig(stage_layers=stage_layers(config)) "
                "of this model's TransformerConfig"
            )
        return functools.partial(self._step, forward_step, record=False)

    def recording(self, forward_step: ForwardStep) -> ForwardStep:
        """``forward_step`` recording the routers' own choices into ``recorded`` (forward-only)."""
        self.recorded.clear()
        return functools.partial(self._step, forward_step, record=True)

    def wrap(
        self, forward_step: ForwardStep, *, forward_only: bool, layers: SeqRange | None = None
    ) -> ForwardStep:
        """``recording`` for a forward-only pass with ``record_forward_only``, else ``replaying``."""
        if forward_only and self.record_forward_only:
            return self.recording(forward_step)
        return self.replaying(forward_step, layers=layers)

    def metrics(self) -> dict[str, float]:
        """Routing bytes of the micro-batches replayed so far (cumulative):

        - ``bytes_read``: rows this rank took from its micro-batches' field (its stage's layers
          of its sequence-parallel tokens) -- exactly what its routers consume, so
          ``bytes_read_ratio`` (read / consumed) is 1.0;
        - ``bytes_delivered``: the field's bytes in those micro-batches (every token of the
          (DP, CP) group, its stage's layers when the plan splits them: NOTE [ One ring per
          pipeline stage ]), and ``delivered_ratio`` (delivered / consumed): the
          sequence-parallel TP ranks of a stage share one packed micro-batch.
        """
        read, delivered = self._bytes["read"], self._bytes["delivered"]
        return {
            "knitkit/routing/bytes_read": float(read),
            "knitkit/routing/bytes_delivered": float(delivered),
            "knitkit/routing/bytes_read_ratio": 1.0 if read else 0.0,
            "knitkit/routing/delivered_ratio": delivered / read if read else 0.0,
        }

    def gathered(self) -> list[torch.Tensor]:
        """``recorded`` with each micro-batch's tokens whole: ``[T, stage layers, topk]`` in the
        stored dtype, all-gathered over TP under sequence parallelism (a collective: every TP
        rank calls it). What a recording pass writes back as the ``routing`` field (one stage)."""
        assert self.num_experts is not None
        dtype = getattr(torch, routing_dtype(self.num_experts).name)
        sp_size = self._sp[1]
        out = []
        for rows in self.recorded:
            if sp_size > 1:
                from megatron.core import parallel_state as ps

                pieces = [torch.empty_like(rows) for _ in range(sp_size)]
                torch.distributed.all_gather(
                    pieces, rows.contiguous(), group=ps.get_tensor_model_parallel_group()
                )
                rows = torch.cat(pieces)
            out.append(rows.to(dtype))
        return out

    def clear(self) -> None:
        """Drop every target, FIFO entry, record and action of this model's routers."""
        for _, router in self._routers:
            router.clear_indices()
            router.clear_router_replay_action()

    def indices(self, batch: Mapping[str, Any]) -> list[torch.Tensor]:
        """This chunk's rows of the batch's routing, one int64 ``[T_local, topk]`` per router."""
        routing = batch.get(self.key)
        if not isinstance(routing, torch.Tensor):
            raise ValueError(
                f"rank {_rank()}: the micro-batch has no {self.key!r} field to replay; add "
                f"{self.key!r} to the pass's reads (Pass(reads=(..., {self.key!r})))"
            )
        if routing.dim() == 4 and routing.shape[0] == 1:
            routing = routing[0]
        stage = len(self.layers)
        if routing.dim() != 3 or routing.shape[1] not in (self._num_layers, stage):
            raise ValueError(
                f"rank {_rank()}: field {self.key!r} is {list(routing.shape)}; the model has "
                f"{self._num_layers} decoder layers, so [tokens, {self._num_layers}, topk] is "
                f"expected (or [tokens, {stage}, topk], this stage's layers "
                f"{list(self.layers)}, from a plan with StageLayers; store SGLang's routed "
                "experts with routing_shape=(num_hidden_layers, num_experts_per_tok) of this model)"
            )
        # every layer (layer_number - 1), or this stage's only (column i for router i)
        offset = 0 if routing.shape[1] == self._num_layers or not stage else self.layers[0]
        sp_rank, sp_size = self._sp
        if routing.shape[0] % sp_size:
            raise ValueError(
                f"rank {_rank()}: field {self.key!r} has {routing.shape[0]} tokens, not a "
                f"multiple of the sequence-parallel size {sp_size}; plan with "
                "Topology(sequence_parallel=True)"
            )
        rows = stage_rows(routing, sp_rank, sp_size)
        local = rows.shape[0]
        self._check_ids(rows)
        taken = [rows[:, layer - offset].long() for layer in self.layers]
        self._bytes["delivered"] += routing.numel() * routing.element_size()
        self._bytes["read"] += local * len(taken) * routing.shape[2] * routing.element_size()
        return taken

    def _check_ids(self, rows: torch.Tensor) -> None:
        assert self.num_experts is not None
        message = (
            f"rank {_rank()}: field {self.key!r} holds an expert id outside "
            f"[0, {self.num_experts}); the stored routing is not this model's (num_experts)"
        )
        if rows.numel() == 0:
            return
        if rows.device.type == "cpu":
            if int(rows.max()) >= self.num_experts:
                raise ValueError(message)
        else:  # no host sync per micro-batch on a device
            torch._assert_async(rows.max() < self.num_experts, message)

    def _step(
        self,
        forward_step: ForwardStep,
        data_iterator: Iterator[Any],
        model: torch.nn.Module,
        *,
        record: bool,
    ) -> tuple[torch.Tensor, Callable[..., Any]]:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def take() -> Any:
            batch = next(data_iterator)
            if record:
                for _, router in self._routers:
                    router.set_router_replay_action(RouterReplayAction.RECORD)
                return batch
            for (_, router), rows in zip(self._routers, self.indices(batch), strict=True):
                router.set_target_indices(rows)
                router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            return batch

        output, loss_func = forward_step(_Taking(take), model)
        if record:
            self.recorded.append(self._recorded())
        for _, router in self._routers:  # see NOTE [ Routing replay in the schedule ]
            if record:
                router.clear_router_replay_action()
                continue
            router.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            if not self._recompute:  # nothing pops this micro-batch's rows
                router.replay_backward_list.pop()
        return output, loss_func

    def _recorded(self) -> torch.Tensor:
        rows = [router.get_recorded_indices() for _, router in self._routers]
        if any(r is None for r in rows):
            raise RuntimeError(
                f"rank {_rank()}: a router recorded nothing; the forward step must run the model"
            )
        return torch.stack([r for r in rows if r is not None], dim=1)


def stage_rows(routing: torch.Tensor, sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """The rows of a packed micro-batch's ``[T, layers, topk]`` routing that one rank's routers
    see: its contiguous 1/``sp_size`` of the tokens under sequence parallelism (a view; the
    rank then reads only its stage's layers of it)."""
    local = routing.shape[0] // sp_size
    return routing[sp_rank * local : (sp_rank + 1) * local]


class _Taking:
    """The data iterator a wrapped forward step sees: each ``next`` hands routing over first."""

    def __init__(self, take: Callable[[], Any]) -> None:
        self._take = take

    def __iter__(self) -> _Taking:
        return self

    def __next__(self) -> Any:
        return self._take()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
