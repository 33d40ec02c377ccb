"""The per-rank job handle on megatron-core: placed by ``parallel_state``, yielding megatron batches per pass."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from knitkit.encoder_dedup import RankRoute
from knitkit.integration.megatron.batch import PackedShapes, megatron_batch, megatron_batches
from knitkit.integration.megatron.device import current_device
from knitkit.integration.megatron.mrope import MROPE_FIELD
from knitkit.integration.megatron.routing import ROUTING_FIELD
from knitkit.integration.megatron.routing_replay import ForwardStep, RoutingReplay
from knitkit.integration.megatron.topology import MegatronLayout
from knitkit.job import Pass, PassWork, RankCoords, RankHandle, RankSpec
from knitkit.microbatch_iter import MicroBatch
from knitkit.storage import MiniBatchPlan
from knitkit.types import SeqRange, UnitKey

ToBatch = Callable[[MicroBatch], Mapping[str, object]]
"""A packed micro-batch -> the dict a forward step takes (``megatron_batch``, ``mrope_batch``)."""

_CONSUMED = frozenset({"tokens", "labels", "loss_mask", "logprobs", MROPE_FIELD})
"""Stored fields the batch builders already turn into megatron's names."""


class MegatronRank:
    """A ``RankHandle`` for one megatron-core rank: its coordinates from ``parallel_state``,
    each pass's micro-batches as the data iterator ``get_forward_backward_func()`` consumes,
    the dedup route for ``DedupVLMStep.run``, and write-back of per-token outputs.

    ``for work in rank.passes():`` yields a ``MegatronPass`` per (mini-batch, pass), in the
    driver's order, the same on every rank.
    """

    def __init__(
        self,
        handle: RankHandle,
        layout: MegatronLayout,
        to_batch: ToBatch,
        routing: RoutingReplay | None = None,
        shapes: PackedShapes | None = None,
    ) -> None:
        self.handle = handle
        self.layout = layout
        self.routing = routing
        """MoE routing replay of the policy model, if any (``MegatronPass.forward_step``)."""
        self._convert = _PassBatch(to_batch, layout, handle.spec.pipeline, shapes or PackedShapes())

    @classmethod
    def from_parallel_state(
        cls,
        spec: RankSpec,
        *,
        to_batch: ToBatch | None = None,
        config: RankHandle.Config | None = None,
        sequence_parallel: bool = False,
        routing: RoutingReplay | None = None,
        shapes: PackedShapes | None = None,
    ) -> MegatronRank:
        """Attach this rank to the job (a collective: every rank of the world calls it).

        Coordinates come from ``MegatronLayout.from_parallel_state()``: the (DP, CP) group's
        ring of its pipeline stage as consumer ``tp_rank``, the schedule as the global rank, and, on the
        first pipeline stage, the encoder rank ``MegatronLayout.encoder_topology`` places here
        (TP-sharded when ``spec.encoders[0].tp > 1``). ``to_batch`` defaults to
        ``megatron_batch`` at the layout's CP size. ``ValueError`` names any mismatch between
        the driver's spec and megatron's layout. ``routing`` replays MoE routing in every pass
        (``MegatronPass.forward_step``). ``shapes``: the cache of micro-batch layouts the
        rank's conversion keeps (NOTE [ Conversion by layout ]); give the one ``to_batch`` uses
        to share it.
        """
        from megatron.core import parallel_state as ps

        layout = MegatronLayout.from_parallel_state(sequence_parallel=sequence_parallel)
        if spec.topology != layout.topology:
            raise ValueError(
                f"the driver plans for {spec.topology} but megatron runs {layout.topology}; build "
                "Driver.Config(topology=MegatronLayout.from_parallel_state().topology, ...)"
            )
        stages = ps.get_pipeline_model_parallel_world_size()
        if spec.pipeline != stages:
            raise ValueError(
                f"the driver serves {spec.pipeline} pipeline stages, megatron runs {stages}; "
                "build Driver.Config(pipeline=...) to match"
            )
        stage = ps.get_pipeline_model_parallel_rank()
        dp, cp, tp = layout.coord
        encoder_rank, consumer = None, 0
        if spec.encoders and stage == 0:
            encoder = spec.encoders[0]
            sharded = encoder.tp > 1
            expected = layout.encoder_topology(encoder.name, encoder.kinds, tp_sharded=sharded)
            if encoder != expected:
                raise ValueError(
                    f"the driver's encoder is {encoder}, megatron's layout gives {expected}; "
                    "build Driver.Config(encoders=(layout.encoder_topology(...),))"
                )
            encoder_rank = layout.dp_cp_ranks[layout.rank] if sharded else layout.rank
            consumer = tp if sharded else 0
        coords = RankCoords(dist.get_rank(), dp, cp, tp, stage, encoder_rank, consumer)
        route = None
        if spec.encoders:
            route = functools.partial(layout.route, encoder=spec.encoders[0].name)
        shapes = shapes or PackedShapes()
        cp = layout.topology.cp
        batch = to_batch or functools.partial(megatron_batch, cp_size=cp, shapes=shapes)
        convert = _PassBatch(batch, layout, spec.pipeline, shapes)  # on the prefetch thread
        handle = RankHandle(
            spec, coords, config, device=current_device(), route=route, convert=convert
        )
        return cls(handle, layout, batch, routing, shapes)

    def passes(self) -> Iterator[MegatronPass]:
        """Every pass the driver serves, in order, until it finishes."""
        while (work := self.next_pass()) is not None:
            yield work

    def next_pass(self, timeout_s: float | None = None) -> MegatronPass | None:
        """The next (mini-batch, pass), or ``None`` once the driver finished."""
        work = self.handle.next_pass(timeout_s)
        return None if work is None else MegatronPass(work, self)

    def metrics(self) -> dict[str, float]:
        return self.handle.metrics()

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> MegatronRank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def batch(self, work: PassWork, micro_batch: MicroBatch) -> Mapping[str, object]:
        """``to_batch(micro_batch)`` plus every other field the pass reads: per-token fields
        ``[1, T, ...]`` under their own names, scalar fields spread over each sequence's local
        tokens (padding included) as ``[1, T, ...]``."""
        return self._convert(work, micro_batch)


@dataclass(frozen=True, slots=True)
class _PassBatch:
    """``MegatronRank.batch`` as the handle's ``convert``: run on each pass's prefetch thread
    (NOTE [ Conversion on the prefetch thread ] in knitkit/microbatch_iter/iterator.py)."""

    to_batch: ToBatch
    layout: MegatronLayout
    pipeline: int
    shapes: PackedShapes

    def __call__(self, work: PassWork, micro_batch: MicroBatch) -> Mapping[str, object]:
        batch = dict(self.to_batch(micro_batch))
        clone = self.pipeline > 1  # several micro-batches in flight
        scalars = (
            set(work.consumer.micro_batches[0].scalar_fields) if work.num_micro_batches else set()
        )
        owner: torch.Tensor | None = None  # each local token's sequence, built once per layout
        for name in work.pass_.reads:
            if name in batch or name in _CONSUMED:
                continue
            value = micro_batch[name]
            if name in scalars:
                if owner is None:
                    owner = self.shapes.get(micro_batch, self.layout.topology.cp).owner
                value = value.index_select(0, owner)
            batch[name] = (value.clone() if clone else value)[None]
        return batch


class MegatronPass:
    """One pass on a megatron rank: its ``PassWork`` (``work``) plus what ``DedupVLMStep.run``
    and its caller need: ``data_iterator()``, ``route``, ``encode_fn(...)`` and
    ``write_back_outputs(...)``. Leaving ``with`` finishes the pass (``PassWork.done``)."""

    def __init__(self, work: PassWork, rank: MegatronRank) -> None:
        self.work = work
        self._rank = rank

    @property
    def minibatch_id(self) -> str:
        return self.work.minibatch_id

    @property
    def pass_(self) -> Pass:
        return self.work.pass_

    @property
    def forward_only(self) -> bool:
        return self.work.pass_.forward_only

    @property
    def records_routing(self) -> bool:
        """Whether this pass writes ``routing`` (it records the routers' choices, not replays)."""
        return any(o.name == ROUTING_FIELD for o in self.pass_.writes)

    @property
    def num_micro_batches(self) -> int:
        return self.work.num_micro_batches

    @property
    def route(self) -> RankRoute:
        """This rank's dedup route (``MegatronLayout.route`` of the mini-batch's plan)."""
        return self.work.route

    @property
    def plan(self) -> MiniBatchPlan:
        """The mini-batch's one plan, restricted to this pass's fields."""
        return self.work.plan

    def encoder_inputs(self) -> dict[UnitKey, torch.Tensor]:
        """This rank's unique units of the pass, by key (``PassWork.encoder_inputs``)."""
        return self.work.encoder_inputs()

    def data_iterator(self) -> Iterator[Mapping[str, object]]:
        """The schedule's data iterator: this pass's micro-batches, prefetched, as megatron
        batches (``get_forward_backward_func()(data_iterator=...)``)."""
        micro_batches = self.work.micro_batches()
        if self._rank.handle.convert is not None:  # converted on the prefetch thread
            return iter(micro_batches)
        return megatron_batches(micro_batches, functools.partial(self._rank.batch, self.work))

    def forward_step(self, forward_step: ForwardStep) -> ForwardStep:
        """``forward_step`` with the rank's MoE routing replay (``MegatronRank(routing=...)``):
        a pass that writes ``routing`` records it (``write_back_routing``), every other pass
        replays each micro-batch's stored ``routing`` (a pass that does not read it fails on its
        first micro-batch, naming the field and the rank); leaving the pass clears every router
        (NOTE [ Routing replay in the schedule ]). Without a replay, ``forward_step`` itself."""
        replay = self._rank.routing
        if replay is None:
            return forward_step
        if self.records_routing:
            return replay.recording(forward_step)
        return replay.replaying(forward_step, layers=self.stage_layers)

    @property
    def stage_layers(self) -> SeqRange | None:
        """The decoder layers of ``routing`` this rank's micro-batches carry: its pipeline
        stage's when the plan splits them (``PlannerConfig(stage_layers=...)``, NOTE [ One ring
        per pipeline stage ] in knitkit/storage/planning/plan.py), ``None`` for every layer."""
        split = self.work.plan.stage_layers
        if (
            split is None
            or ROUTING_FIELD not in split.fields
            or self._rank.handle.spec.pipeline == 1
        ):
            return None
        return split.ranges[self._rank.handle.coords.stage]

    def write_back_routing(self, replay: RoutingReplay | None = None) -> None:
        """Write the routing a recording pass took back into the store (a collective over TP:
        every rank of the pass calls it; the group's writer sends). ``replay`` is the one that
        recorded (default: the rank's; another model's, e.g. a rollout policy's, works too)."""
        replay = replay or self._rank.routing
        if replay is None or not self.records_routing:
            raise ValueError(
                f"pass {self.pass_.name!r} records no routing; give MegatronRank(routing=...) and "
                f"Output({ROUTING_FIELD!r}, 'uint8', (layers, topk)) in the pass's writes"
            )
        if self._rank.handle.spec.pipeline > 1:
            raise ValueError(
                f"pass {self.pass_.name!r}: recording routing under pipeline parallelism would "
                "write back the last stage's layers only; record on one stage"
            )
        rows = replay.gathered()
        self.write_back_outputs([{"routing": r} for r in rows], {ROUTING_FIELD: "routing"})

    def encode_fn(
        self, encode: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[Sequence[UnitKey]], torch.Tensor]:
        """``DedupVLMStep.run``'s ``encode_fn``: ``encode(unit input)`` for each key, in order,
        on this rank's encoder inputs of the pass (read from its ring once, when first needed)."""

        def encode_fn(keys: Sequence[UnitKey]) -> torch.Tensor:
            inputs = self.work.encoder_inputs()
            return torch.cat([encode(inputs[key]) for key in keys])

        return encode_fn

    def write_back_outputs(
        self, outputs: Sequence[Mapping[str, torch.Tensor]], fields: Mapping[str, str]
    ) -> None:
        """Write megatron's per-token outputs back: ``outputs`` is what the schedule returned
        (one dict per micro-batch on the last stage, nothing elsewhere), ``fields`` maps each
        field the pass writes to the key holding its packed CP-local ``[T]`` / ``[1, T]``
        values. Only the group's writer rank (TP 0 of the last stage) sends."""
        if not self._rank.handle.writer:
            return
        if len(outputs) != self.work.num_micro_batches:
            raise ValueError(
                f"pass {self.work.pass_.name!r}: {len(outputs)} outputs for "
                f"{self.work.num_micro_batches} micro-batches; pass what the schedule returned "
                "on the last pipeline stage"
            )
        for index, output in enumerate(outputs):
            self.work.write_back(index, {name: output[key] for name, key in fields.items()})

    def writing_back(
        self,
        forward_step: ForwardStep,
        fields: Mapping[str, str],
        *,
        around: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> ForwardStep:
        """``forward_step`` whose loss function writes each micro-batch's per-token outputs back
        as the schedule computes it (``fields`` as for ``write_back_outputs``), instead of
        ``write_back_outputs`` after the schedule: a later pass of the step that reads them gets
        its micro-batches as they arrive (NOTE [ Serving as write-backs arrive ] in
        knitkit/job/serving.py). Micro-batches are numbered in the order the last stage computes
        their losses: megatron's schedules keep the data order. Each write-back runs inside
        ``around()`` (e.g. a timer of the data path)."""
        computed = itertools.count()

        def loss(loss_func: Callable[..., Any], output_tensor: torch.Tensor) -> Any:
            result = loss_func(output_tensor)
            outputs = result[-1]  # megatron's loss functions return (loss, [tokens,] dict)
            with around():
                values = {name: outputs[key] for name, key in fields.items()}
                self.work.write_back(next(computed), values)
            return result

        def step(
            data_iterator: Iterator[Any], model: torch.nn.Module
        ) -> tuple[torch.Tensor, Callable[..., Any]]:
            output, loss_func = forward_step(data_iterator, model)
            return output, functools.partial(loss, loss_func)

        return step

    def report(self, figures: Mapping[str, float]) -> None:
        """Figures for the driver's observer (``PassWork.report``)."""
        self.work.report(figures)

    def done(self) -> None:
        self.work.done()

    def __enter__(self) -> MegatronPass:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._rank.routing is not None:
            self._rank.routing.clear()
        self.work.__exit__(exc_type, exc, tb)
