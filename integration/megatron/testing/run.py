"""One check on one rank: both models, the store and plan, the reference and the wrapped runs."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from knitkit.encoder_dedup import Comparison, EquivalenceReport, Tolerance, feature_slices
from knitkit.integration.megatron.batch import megatron_batches
from knitkit.integration.megatron.device import current_device
from knitkit.integration.megatron.pipeline import PipelineStage
from knitkit.integration.megatron.step import DedupVLMStep
from knitkit.integration.megatron.te import batch_for, te_available
from knitkit.integration.megatron.testing.contract import checked_step
from knitkit.integration.megatron.testing.models import (
    build,
    grad_of,
    module_at,
    owned_grad,
    same_weights,
    unit_encoder,
    unwrap,
)
from knitkit.integration.megatron.testing.reference import CallCounter, with_images
from knitkit.integration.megatron.testing.subject import VLMUnderTest, resolve
from knitkit.integration.megatron.topology import MegatronLayout
from knitkit.microbatch_iter import MicroBatch, MicroBatchIterator, PackedMicroBatch
from knitkit.storage import (
    MemoryBackend,
    MicroBatchPlan,
    MiniBatchPlan,
    PlannerConfig,
    Trajectory,
    TrajectoryStore,
    pack,
    plan_minibatch,
)
from knitkit.types import UnitKey

Pair = tuple[str, torch.nn.Parameter, torch.nn.Parameter, Any, Any]
"""(row name, reference parameter, wrapped parameter, reference chunk, wrapped chunk)."""


@dataclass(slots=True)
class CheckRun:
    """Both models of one check on this rank, built alike, and the mini-batch planned for the layout."""

    subject: VLMUnderTest
    store: TrajectoryStore
    plan: MiniBatchPlan
    layout: MegatronLayout
    reference: list[Any]
    wrapped: list[Any]
    """This rank's model chunks (Megatron DDP), reference and wrapped."""
    step: DedupVLMStep
    config: Any
    """The wrapped model's ``TransformerConfig``."""
    unique_units: int
    encoder: Callable[[torch.Tensor], torch.Tensor] | None
    """The wrap's per-unit encoder (first stage only, else ``None``; built before any swap)."""
    originals: tuple[object, object]
    """The wrapped model's ``finalize_model_grads_func`` and vision module as built."""
    encoded: int = 0
    """Units the wrap encoded in its training passes."""
    reencoded: int = 0
    """Unit pieces the reference encoded in its training passes."""
    encoded_forward_only: int = 0
    """Units the wrap encoded in its forward-only pass."""
    problems: list[str] = field(default_factory=list)
    stopped: bool = False
    """A training pass found the wrap cannot be run on this model as declared (``problems``)."""

    @classmethod
    def build(
        cls,
        subject: VLMUnderTest,
        trajectories: Sequence[Trajectory],
        planner: PlannerConfig | None,
        seed: int,
    ) -> CheckRun:
        """Build both models from ``subject.provider`` with the same seed and plan the mini-batch."""
        from megatron.core.utils import get_model_config

        reference, wrapped = build(subject, seed), build(subject, seed)
        same_weights(reference, wrapped)
        config = get_model_config(wrapped[0])
        layout = MegatronLayout.from_parallel_state(sequence_parallel=config.sequence_parallel)
        store = TrajectoryStore(MemoryBackend())
        for trajectory in trajectories:
            store.write(trajectory)
        metas = store.metas([t.trajectory_id for t in trajectories])
        fields = subject.token_fields or tuple(trajectories[0].token_fields)
        plan = plan_minibatch(
            metas,
            layout.topology,
            planner or PlannerConfig(token_fields=fields, scalar_fields=(), min_micro_batches=3),
            encoders=[layout.encoder_topology(tp_sharded=subject.tp_sharded_vision)],
        )
        plan = store.register(plan)  # names fields some trajectories lack, before any packing
        step = DedupVLMStep(
            wrapped if len(wrapped) > 1 else wrapped[0],
            vision=subject.vision,
            tp_sharded_vision=subject.tp_sharded_vision,
            vision_extra=subject.vision_extra,
        )
        first = PipelineStage.current().encodes
        encoder = unit_encoder(subject, wrapped[0]) if first else None
        unique = len({ref.key for meta in metas for ref in meta.multimodal})
        vision = module_at(unwrap(wrapped[0]), subject.vision) if first else None
        originals = (config.finalize_model_grads_func, vision)
        return cls(
            subject,
            store,
            plan,
            layout,
            reference,
            wrapped,
            step,
            config,
            unique,
            encoder,
            originals,
        )

    # ----- passes: each returns this rank's rows --------------------------------------------------
    def training_pass(self, tol: Tolerance) -> EquivalenceReport:
        """Zeroed buffers, one mini-batch through both; gradients and loss dicts compared.

        Between the two runs, a vision path declared replicated is checked to be so (see
        NOTE [ Hand sharding shows in the reference ]); if it is not, the wrap is not run and
        ``stopped`` is set.
        """
        self._zero_grads()
        ref_out = self._reference(forward_only=False)
        if self._sharded_by_hand(tol):
            self.stopped = True
            return _report(tol, [], [])
        got_out = self._wrapped(forward_only=False)
        self.encoded += self.step.last_encoded_units
        rows = [
            Comparison.of(
                name, owned_grad(chunk, mine), owned_grad(ref_chunk, ref), dist.get_rank(), tol
            )
            for name, ref, mine, ref_chunk, chunk in self.pairs()
        ]
        return _report(tol, rows, outputs("train", got_out, ref_out, tol))

    def forward_only_pass(self, tol: Tolerance) -> EquivalenceReport:
        """Both models forward-only (log-prob passes): loss dicts compared, no gradient left behind."""
        self._zero_grads()
        with torch.no_grad():
            ref_out = self._reference(forward_only=True)
        got_out = self._wrapped(forward_only=True)
        self.encoded_forward_only += self.step.last_encoded_units
        left = [n for n, _, mine, _, _ in self.pairs() if bool(grad_of(mine).abs().sum() > 0)]
        if left:
            self.problems.append(f"the forward-only pass left gradients in {', '.join(left[:3])}")
        return _report(tol, [], outputs("forward_only", got_out, ref_out, tol))

    def optimizer_step(self, optimizers: Sequence[Any], tol: Tolerance) -> EquivalenceReport:
        """Step both models with megatron's optimizer; the stepped parameters must agree too."""
        for optimizer in optimizers:
            if not optimizer.step()[0]:
                self.problems.append("megatron's optimizer skipped a step (found inf/nan)")
        for chunk in (*self.reference, *self.wrapped):
            if chunk.ddp_config.overlap_param_gather:  # otherwise the next forward gathers
                chunk.start_param_sync(force_sync=True)
        rows = [
            Comparison.of(f"param:{name}", mine.detach(), ref.detach(), dist.get_rank(), tol)
            for name, ref, mine, _, _ in self.pairs()
        ]
        return _report(tol, rows, [])

    def sgd(self, lr: float) -> None:
        """A plain SGD update of both models on their whole ``main_grad`` (none with ``lr=0``)."""
        if lr == 0:
            return
        for _, ref, mine, ref_chunk, _ in self.pairs():
            if ref_chunk.ddp_config.use_distributed_optimizer:
                raise ValueError(
                    "steps > 1 with use_distributed_optimizer=True: pass optimizer=... "
                    "(megatron's DistributedOptimizer steps only this rank's shard)"
                )
            for param in (ref, mine):
                param.data.add_(grad_of(param).view_as(param), alpha=-lr)

    def check_restored(self) -> None:
        """The wrap leaves the user's model as it found it: its vision path and finalize func."""
        finalize, vision = self.originals
        if self.encoder is not None:
            now = module_at(unwrap(self.wrapped[0]), self.subject.vision)
            if now is not vision:
                self.problems.append(
                    f"the wrap left a {type(now).__name__} at {self.subject.vision!r}"
                )
            if list(unwrap(self.wrapped[0]).state_dict()) != list(
                unwrap(self.reference[0]).state_dict()
            ):
                self.problems.append("the wrap changed the model's state_dict keys")
        if self.config.finalize_model_grads_func is not finalize:
            self.problems.append("the wrap left config.finalize_model_grads_func replaced")

    def pairs(self) -> Iterator[Pair]:
        """Every trainable parameter of this rank, named per stage and chunk under PP."""
        for c, (ref_chunk, chunk) in enumerate(zip(self.reference, self.wrapped, strict=True)):
            prefix = self.prefix(c)
            for (name, ref), mine in zip(
                unwrap(ref_chunk).named_parameters(), unwrap(chunk).parameters(), strict=True
            ):
                if ref.requires_grad:
                    yield prefix + name, ref, mine, ref_chunk, chunk

    def prefix(self, chunk: int, stage: int | None = None) -> str:
        """``stage{s}.`` under PP and ``chunk{c}.`` with virtual chunks, so rows stay distinct."""
        from megatron.core import parallel_state as ps

        stage = PipelineStage.current().rank if stage is None else stage
        staged = ps.get_pipeline_model_parallel_world_size() > 1
        return (f"stage{stage}." if staged else "") + (
            f"chunk{chunk}." if len(self.reference) > 1 else ""
        )

    # ----- the two runs ---------------------------------------------------------------------------
    def _reference(self, *, forward_only: bool) -> list[Any]:
        """megatron's schedule on the unwrapped model, its own forward and vision path (see NOTE
        [ Re-encoding reference ])."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        subject = self.subject
        with contextlib.ExitStack() as stack:
            feeds, micro_batches = stack.enter_context(self._feeds())
            vision: CallCounter | None = None
            if self.encoder is not None:  # the first stage: its batches carry the images
                make = resolve(subject.reference_batches or with_images)
                feeds[0] = iter(make(micro_batches, feeds[0], self._load))
                module = module_at(unwrap(self.reference[0]), subject.vision)
                vision = stack.enter_context(CallCounter(module))
            out = get_forward_backward_func()(
                forward_step_func=self._step_func(forward_only=forward_only, reference=True),
                data_iterator=feeds if len(feeds) > 1 else feeds[0],
                model=self.reference,
                num_microbatches=self.plan.num_micro_batches,
                seq_length=self._seq_length(),
                micro_batch_size=1,
                forward_only=forward_only,
            )
        if vision is not None:
            consuming = sum(1 for mb in micro_batches if feature_slices(mb))
            if not forward_only:
                self.reencoded += sum(len(feature_slices(mb)) for mb in micro_batches)
            if vision.calls < consuming:
                self.problems.append(
                    f"the reference's vision path {subject.vision!r} ran {vision.calls} times for "
                    f"{consuming} micro-batches with images: the forward step must hand the "
                    "model batch['images'] and the model's forward must call its vision path on "
                    "them (see the contract in integration/megatron/README.md)"
                )
        return list(out)

    def _wrapped(self, *, forward_only: bool) -> list[Any]:
        """``DedupVLMStep.run`` on the wrapped model."""
        encoder = self.encoder

        def encode_fn(keys: Sequence[UnitKey]) -> torch.Tensor:
            assert encoder is not None  # only the first stage encodes
            rows = torch.cat([encoder(self._load(key)) for key in keys])
            if forward_only and rows.requires_grad:
                self.problems.append("the forward-only pass kept an encoder graph")
            return rows

        with self._feeds() as (feeds, _):
            return self.step.run(
                forward_step_func=self._step_func(forward_only=forward_only, reference=False),
                data_iterator=feeds if len(feeds) > 1 else feeds[0],
                route=self.layout.route(self.plan),
                encode_fn=encode_fn,
                num_microbatches=self.plan.num_micro_batches,
                seq_length=self._seq_length(),
                micro_batch_size=1,
                forward_only=forward_only,
            )

    def _step_func(self, *, forward_only: bool, reference: bool) -> Callable[..., Any]:
        """The forward step of a pass: ``forward_only_step`` for forward-only passes (both
        models), the training step otherwise (``reference_forward_step`` for the reference)."""
        subject = self.subject
        if forward_only and subject.forward_only_step is not None:
            return checked_step("forward_only_step", subject.forward_only_step)
        if reference and subject.reference_forward_step is not None:
            return checked_step("reference_forward_step", subject.reference_forward_step)
        return checked_step("forward_step", subject.forward_step)

    def _sharded_by_hand(self, tol: Tolerance) -> bool:
        """Whether a vision parameter declared replicated got different reference gradients on
        the TP ranks (named in ``problems``); the same answer on every rank of the world.

        NOTE [ Hand sharding shows in the reference ]: megatron never reduces a replicated
        parameter's gradient over TP: it relies on every TP rank computing the same one, as it
        does when the TP ranks run the same layers on the same images. A vision path split over
        TP by hand (plain torch layers exchanging activations through the TP group, without
        megatron's ``tensor_model_parallel`` marks that ``DedupVLMStep`` reads) breaks that: each
        rank's slice of a parameter gets its own gradient. Declared replicated, the wrap would
        hand its TP ranks different units, and the layers' exchange would pair rows of different
        images, or, for images of different sizes, die inside the collective with nothing said.
        So after the reference's training pass, before the wrap runs, the TP ranks compare each
        unmarked vision parameter's gradient (its shape, sum, absolute sum and a position-weighted
        sum) and the check stops, naming the parameters that differ.
        """
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        mine: list[tuple[str, tuple[int, ...], tuple[float, ...]]] = []
        if self.encoder is not None and not self.subject.tp_sharded_vision and tp > 1:
            first = self.prefix(0, stage=0)
            paths = tuple(f"{first}{p}." for p in (self.subject.vision, *self.subject.vision_extra))
            for name, ref, _, ref_chunk, _ in self.pairs():
                if name.startswith(paths) and not getattr(ref, "tensor_model_parallel", False):
                    grad = owned_grad(ref_chunk, ref).double()
                    weights = torch.arange(
                        1, grad.numel() + 1, dtype=grad.dtype, device=grad.device
                    )
                    sums = (grad.sum(), grad.abs().sum(), (grad * weights / grad.numel()).sum())
                    mine.append((name, tuple(ref.shape), tuple(float(x) for x in sums)))
        differ: list[str] = []
        if mine:
            peers: list[Any] = [None] * tp
            dist.all_gather_object(peers, mine, group=ps.get_tensor_model_parallel_group())
            for i, (name, shape, stats) in enumerate(mine):
                for peer in peers:
                    _, peer_shape, peer_stats = peer[i]
                    scale = max(abs(stats[1]), tol.floor)
                    if peer_shape != shape or any(
                        abs(a - b) > tol.rtol * scale
                        for a, b in zip(stats, peer_stats, strict=True)
                    ):
                        differ.append(name)
                        break
        if differ:
            self.problems.append(
                f"the vision path is declared replicated (tp_sharded_vision=False) but "
                f"{len(differ)} of its parameters got different reference gradients on the "
                f"{tp} TP ranks ({', '.join(differ[:4])}): it is split over TP by hand, without "
                "megatron's tensor_model_parallel marks; mark its sharded parameters with "
                "megatron.core.tensor_parallel.set_tensor_model_parallel_attributes and declare "
                "tp_sharded_vision=True (the wrap was not run: its TP ranks would encode "
                "different images through layers that exchange rows)"
            )
        flag = torch.tensor([float(bool(differ))], device=current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @contextlib.contextmanager
    def _feeds(self) -> Iterator[tuple[list[Iterator[Any]], Sequence[MicroBatchPlan]]]:
        """One data iterator per model chunk over this rank's packed micro-batches."""
        micro_batches = self.plan.consumer(*self.layout.coord[:2]).micro_batches
        to_batch = (
            resolve(self.subject.to_batch)
            if self.subject.to_batch is not None
            else batch_for(te_available(), self.layout.topology.cp)
        )
        schema = self.store.schema(micro_batches[0].sequences[0].trajectory_id)
        with contextlib.ExitStack() as stack:
            feeds: list[Iterator[Any]] = []
            for _ in self.reference:
                packed = (
                    PackedMicroBatch(*pack(mb, schema, self.store.read_into))
                    for mb in micro_batches
                )
                iterator = stack.enter_context(MicroBatchIterator(packed, device=current_device()))
                feeds.append(megatron_batches(iterator, functools.partial(_copied, to_batch)))
            yield feeds, micro_batches

    def _load(self, key: UnitKey) -> torch.Tensor:
        return torch.from_numpy(self.store.read(key)).to(current_device())

    def _seq_length(self) -> int:
        """The longest micro-batch of the plan on any consumer (the same on every rank)."""
        return max(
            sum(s.local_length for s in mb.sequences)
            for consumer in self.plan.consumers
            for mb in consumer.micro_batches
        )

    def _zero_grads(self) -> None:
        for chunk in (*self.reference, *self.wrapped):
            chunk.zero_grad_buffer()


def outputs(kind: str, got: Sequence[Any], ref: Sequence[Any], tol: Tolerance) -> list[Comparison]:
    """Per micro-batch and key of the schedule's loss dicts (last stage only): ``kind[key]`` rows."""
    rank = dist.get_rank()
    if len(got) != len(ref):
        return [Comparison.of(f"{kind}[micro-batches]", None, torch.zeros(len(ref)), rank, tol)]
    rows = []
    for mine, theirs in zip(got, ref, strict=True):
        mine, theirs = _as_dict(mine), _as_dict(theirs)
        for key in dict.fromkeys([*theirs, *mine]):
            name = f"{kind}[{key}]"
            if key not in mine or key not in theirs:
                rows.append(Comparison(name, float("inf"), 0.0, rank, "missing"))
                continue
            a, b = (torch.as_tensor(v).detach().float() for v in (mine[key], theirs[key]))
            rows.append(Comparison.of(name, a, b, rank, tol))
    return rows


def _as_dict(out: Any) -> Mapping[str, Any]:
    return out if isinstance(out, Mapping) else {"output": out}


def _report(
    tol: Tolerance, gradients: Sequence[Comparison], outputs: Sequence[Comparison]
) -> EquivalenceReport:
    return EquivalenceReport(
        title="", tolerance=tol, gradients=tuple(gradients), outputs=tuple(outputs)
    )


def _copied(
    to_batch: Callable[[MicroBatch], Mapping[str, object]], mb: MicroBatch
) -> dict[str, object]:
    """The batch with its tensors copied out of the prefetch slot (a pipeline holds several)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in to_batch(mb).items()}
