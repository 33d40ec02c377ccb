"""The wrapped Megatron VLM train step: deduplicated encoding around megatron-core's forward-backward schedule."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from knitkit.encoder_dedup import (
    DedupEncoder,
    EncodeFn,
    FinalizeWithDeferredBackward,
    Folded,
    Heard,
    ProcessGroupTransport,
    RankRoute,
    agree,
)
from knitkit.integration.megatron.device import current_device
from knitkit.integration.megatron.grads import DeferredVisionBackward, averaged_over_tp
from knitkit.integration.megatron.pipeline import (
    PipelineStage,
    StepFacts,
    StepRefused,
    agree_on_step,
    refused_step,
    stage_group,
)
from knitkit.integration.megatron.routing_replay import ForwardStep, RoutingReplay

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig


@dataclass(slots=True)
class DedupVLMStep:
    """Runs one mini-batch of a Megatron VLM with every unique multimodal input encoded once.

    The user's model, forward step and loss stay as they are. For the length of ``run`` the vision
    path (encoder + projector, at the dotted attribute ``vision`` of the unwrapped model) is
    replaced by a lookup that hands each backbone micro-batch its cached features as
    ``detach().requires_grad_()`` leaves, and ``config.finalize_model_grads_func`` is wrapped so
    the one deferred encoder backward runs after the last micro-batch's backward and before
    Megatron finishes its gradient reduction, whatever ``overlap_grad_reduce`` is.

    See NOTE [ Vision gradients under Megatron DDP ] in ``grads.py`` for how encoder gradients
    reach every replica.
    """

    model: torch.nn.Module | list[torch.nn.Module]
    """The (DDP-wrapped) model chunk handed to the schedule, or this rank's virtual-pipeline
    chunks in order (the vision path is in the first chunk of the first pipeline stage; pass
    ``data_iterator`` as a list, one iterator per chunk, as megatron's interleaved schedule
    takes it)."""
    vision: str = "vision"
    """Dotted path of the vision path inside the unwrapped model; its output rows must be the
    features of the micro-batch's placeholder tokens, in order."""
    tp_sharded_vision: bool = False
    """True when the vision path is itself TP-sharded (e.g. megatron's ``MultimodalProjector``):
    TP peers then encode together, rows travel in megatron's DP x CP group and no TP sum is
    needed. Plan with ``MegatronLayout.encoder_topology(tp_sharded=True)`` to match. At TP > 1
    ``run`` refuses a value that contradicts megatron's ``tensor_model_parallel`` marks on the
    vision parameters (NOTE [ Declared and detected TP sharding ])."""
    vision_extra: tuple[str, ...] = ()
    """Dotted paths of further modules of the vision path whose parameters the deferred backward
    reaches (e.g. LLaVA's ``vision_projection`` after its ``vision_model``); they join the zero
    anchor and the TP sum but are not swapped."""
    routing: RoutingReplay | None = None
    """MoE routing replay (R3): each micro-batch's stored ``routing`` goes to megatron-core's
    ``RouterReplay`` around its forward, every router is cleared after the schedule (NOTE
    [ Routing replay in the schedule ] in ``routing_replay.py``)."""
    handshake_timeout_s: float = 600.0
    """Bound on every wait for the other ranks: the step's start (NOTE [ Every rank refuses
    together ] in ``pipeline.py``), the encode and the deferred backward, and their row exchanges
    (a rank that never gets there fails everyone with a knitkit error naming the phase and the
    missing rank, not a gloo/NCCL timeout); it must cover the skew between ranks, e.g. their
    backbone micro-batches before the deferred backward."""
    last_encoded_units: int = field(default=0, init=False)
    """Unique units this rank encoded in the last ``run``."""
    _figures: dict[str, float] = field(default_factory=dict, init=False)
    _found: _VisionModules | None = field(default=None, init=False)
    """The vision modules and their parameters as the last ``run`` found them (NOTE [ The vision
    path found once ])."""

    def run(
        self,
        *,
        forward_step_func: Callable[..., object],
        data_iterator: Iterable[object],
        route: RankRoute,
        encode_fn: EncodeFn,
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        **schedule_kwargs: object,
    ) -> list[object]:
        """Encode, run ``get_forward_backward_func()`` over the micro-batches, deferred backward, finalize.

        ``route`` is this rank's route (``MegatronLayout.route(plan)``) and
        ``encode_fn`` maps an encoder micro-batch of unit keys to its feature rows (it calls the
        vision path). Returns what the schedule returns (the loss dicts).

        ``forward_only=True`` (old / reference log-probs passes; pass the reference model's own
        step and ``encode_fn``) encodes each unique unit once without a graph and serves plain
        rows: no encoder backward, no gradient return, ``finalize_model_grads_func`` untouched.

        Before anything collective, every rank of the world checks its inputs and meets the
        others once: a refusal or disagreement on any rank raises ``StepRefused`` on every rank
        (NOTE [ Every rank refuses together ] in ``pipeline.py``).
        """
        replay = self.routing
        if replay is not None:  # see NOTE [ Routing replay in the schedule ]
            forward_only = bool(schedule_kwargs.get("forward_only"))
            wrapped = cast(ForwardStep, forward_step_func)  # the schedule's own contract
            forward_step_func = replay.wrap(wrapped, forward_only=forward_only)
        try:
            return self._run(
                forward_step_func,
                data_iterator,
                route,
                encode_fn,
                num_microbatches,
                schedule_kwargs,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
            )
        finally:
            if replay is not None:
                replay.clear()

    def _run(
        self,
        forward_step_func: Callable[..., object],
        data_iterator: Iterable[object],
        route: RankRoute,
        encode_fn: EncodeFn,
        num_microbatches: int,
        schedule_kwargs: dict[str, object],
        **shape: int,
    ) -> list[object]:
        """``run`` with the forward step as the schedule gets it."""
        forward_only = bool(schedule_kwargs.get("forward_only"))
        vision: _VisionPath | None = None
        failure: Exception | None = None
        stage = PipelineStage.current()
        try:  # see NOTE [ Every rank refuses together ]: nothing local raises before it
            problems = self._refusals(route, num_microbatches, data_iterator)
            if stage.encodes and not problems:
                vision, problems = self._vision_path(route, forward_only)
        except Exception as error:
            failure, problems = error, [f"{type(error).__name__}: {error}"]
        facts = StepFacts(num_microbatches, forward_only, route.plan_fingerprint, tuple(problems))
        folded = self._folded(facts) if self._one_handshake(stage, vision) else None
        try:
            if folded is None:
                agree_on_step(facts, timeout_s=self.handshake_timeout_s)
            elif vision is None or problems:  # tell the peers in the encode handshake, then stop
                self._refuse(route, facts, folded)
        except StepRefused as refused:
            raise refused from failure
        if vision is None:
            # A later stage holds no vision path: see NOTE [ Encoder under pipeline parallelism ]
            # in pipeline.py.
            self.last_encoded_units, self._figures = 0, {}
            return self._schedule(
                forward_step_func, data_iterator, num_microbatches, schedule_kwargs, **shape
            )
        config, dedup = vision.config, vision.dedup
        original = config.finalize_model_grads_func
        named = [(n, p) for _, n, p in vision.found.parameters if p.requires_grad]
        params = tuple(p for _, p in named)
        tp_sum = 1 if forward_only else self._replicas_to_sum()
        dedup.encode(encode_fn, keep_graph=not forward_only, folded=folded)
        self.last_encoded_units = dedup.encoded_units
        data, feed = self._feed(data_iterator)
        if not forward_only:  # a forward-only pass has no encoder backward and no finalize
            hook = FinalizeWithDeferredBackward(original)
            hook.arm(DeferredVisionBackward(dedup, params, scale=float(tp_sum)))
            config.finalize_model_grads_func = hook
        try:
            with (
                self._serving(vision.found, _CachedFeatures(dedup, feed)) as restore,
                averaged_over_tp(named if tp_sum > 1 else (), config),
            ):
                if not forward_only:  # NOTE [ Finalize sees the vision path ]
                    hook.before_finalize = restore
                out = self._schedule(
                    forward_step_func, data, num_microbatches, schedule_kwargs, **shape
                )
        finally:
            config.finalize_model_grads_func = original
        self._figures = dedup.metrics()
        if feed.count != num_microbatches:
            raise RuntimeError(
                f"the forward step took {feed.count} micro-batches for num_microbatches="
                f"{num_microbatches}; it must call next(data_iterator) exactly once per call"
            )
        return out

    def metrics(self) -> dict[str, float]:
        """This rank's dedup figures of the last ``run`` (``DedupEncoder.metrics``; per step, not
        cumulative); empty on pipeline stages without the vision path and before the first run;
        with ``routing``, its figures too (``RoutingReplay.metrics``)."""
        routing = self.routing.metrics() if self.routing is not None else {}
        return {**self._figures, **routing}

    # NOTE [ One handshake per step ]: NOTE [ Every rank refuses together ] (pipeline.py) meets
    # the world once before the step's first collective, and the encode right after it meets the
    # same ranks again (NOTE [ Handshake before rows move ]): two waits for the slowest rank and
    # two gloo rounds per pass, 4 of the ~16 knitkit collectives of a GRPO step on every rank
    # (``benchmarks/grpo_step.py``: old, ref, and the train pass's two epochs). Where the encoder
    # group is the world and encoding is local (PP=1, a vision path without TP-sharded
    # parameters: no collective inside the encoder), the step's facts (num_microbatches, whether
    # the rank refused; forward-only and the plan are in the row already) ride in the encode
    # handshake instead, and its verdict runs first on every rank. What a failing rank sees:
    # - a rank that refuses the step (its own inputs, config, layout) skips its encoder and tells
    #   the handshake; every rank raises the same ``StepRefused`` as before, with the same text.
    #   The peers have encoded locally meanwhile (wasted work, no collective, nothing kept), and
    #   a peer whose own encoder failed in that window raises its own error, not ``StepRefused``;
    # - an encoder that raises: that rank raises its error, the peers ``PeerFailed``, as before;
    # - a rank that never arrives: a bounded TimeoutError naming the missing rank at 'encode'
    #   (the separate all-gather could not name it).
    # Under pipeline parallelism (later stages hold no encoder) or with a TP-sharded vision
    # path (its forward runs TP collectives, which must not start before the ranks agreed), the
    # step keeps its own all-gather first.
    def _one_handshake(self, stage: PipelineStage, vision: _VisionPath | None) -> bool:
        """Whether the step's agreement rides in the encode handshake (NOTE [ One handshake per
        step ]): at PP=1, with a vision path that holds no TP-sharded parameter (the same answer
        on every rank: one model, one layout)."""
        if stage.size > 1:
            return False
        try:
            found = vision.found if vision is not None else self._vision_modules()
        except (AttributeError, TypeError):
            return True  # every rank refuses it alike, in the one handshake
        return not found.sharded

    def _folded(self, facts: StepFacts) -> Folded:
        """The step's facts as extra values of the encode handshake, and their verdict."""
        refused = bool(facts.problems)
        me = dist.get_rank()

        def verdict(heard: list[Heard]) -> None:
            refused_step(me, 0, [_step_row(h) for h in heard])

        return Folded((facts.num_microbatches, int(refused)), verdict)

    def _refuse(self, route: RankRoute, facts: StepFacts, folded: Folded) -> None:
        """A rank that refused the step tells its peers in the encode handshake (its verdict raises
        ``StepRefused`` on every rank; NOTE [ One handshake per step ])."""
        transport = ProcessGroupTransport(stage_group())
        spans = len(route.forward.send_counts) == len(route.backward.send_counts)
        usable = spans and len(route.forward.send_counts) == transport.world_size
        agree(
            route if usable else None,
            transport,
            "encode",
            device=current_device(),
            timeout_s=self.handshake_timeout_s,
            problem="; ".join(facts.problems),
            keep_graph=not facts.forward_only,
            extra=folded.extra,
            verdict=folded.verdict,
        )
        raise StepRefused(f"rank {dist.get_rank()} refused the step: {'; '.join(facts.problems)}")

    def _refusals(
        self, route: RankRoute, num_microbatches: int, data_iterator: Iterable[object]
    ) -> list[str]:
        """What this rank refuses in its own inputs (every stage; NOTE [ Every rank refuses together ])."""
        problems = []
        if len(route.micro_batch_index) != num_microbatches:
            problems.append(
                f"route covers {len(route.micro_batch_index)} backbone micro-batches but "
                f"num_microbatches={num_microbatches}; route and data must come from the same plan"
            )
        chunks = len(self._chunks())
        if not isinstance(data_iterator, Iterable):
            problems.append(f"data_iterator is a {type(data_iterator).__name__}, not iterable")
        elif chunks > 1 and not (
            isinstance(data_iterator, list | tuple) and len(data_iterator) == chunks
        ):
            problems.append(
                f"the model has {chunks} virtual-pipeline chunks; pass data_iterator as a list of "
                f"{chunks} iterators, one per chunk"
            )
        return problems

    def _vision_path(
        self, route: RankRoute, forward_only: bool
    ) -> tuple[_VisionPath | None, list[str]]:
        """The first stage's vision path, its config and dedup encoder, or what this rank refuses."""
        from megatron.core.utils import get_model_config

        problems = []
        config = get_model_config(self._chunks()[0])
        if config.finalize_model_grads_func is None and not forward_only:
            problems.append(
                "config.finalize_model_grads_func is None; set it to "
                "megatron.core.distributed.finalize_model_grads as megatron's training loop does"
            )
        transport = ProcessGroupTransport(self._encoder_group())
        if len(route.forward.send_counts) != transport.world_size:
            problems.append(
                f"route spans {len(route.forward.send_counts)} ranks but the encoder group has "
                f"{transport.world_size}; plan with encoder_topology(tp_sharded="
                f"{self.tp_sharded_vision}) to match DedupVLMStep(tp_sharded_vision=...)"
            )
        try:
            found = self._vision_modules()
        except (AttributeError, TypeError) as error:
            return None, [*problems, str(error)]
        # see NOTE [ Declared and detected TP sharding ]
        problems += self._sharding_refusals(found)
        if problems:
            return None, problems
        dedup = DedupEncoder(
            route,
            transport,
            hidden=config.hidden_size,
            dtype=config.params_dtype,
            device=current_device(),
            handshake_timeout_s=self.handshake_timeout_s,
        )
        return _VisionPath(config, found, dedup), []

    # NOTE [ The vision path found once ]: each pass of a step (old, ref, and each train epoch)
    # needs the vision modules (to swap the lookup in), their parameters (the TP sum and the
    # deferred backward) and whether megatron marked any as TP-sharded (one handshake or two;
    # the sharding check). Walking ``named_parameters`` for each of those and resolving the
    # dotted paths per use cost ~0.25 ms of the training thread per pass (``grpo_step``). A run
    # resolves the paths once (a few attribute reads) and walks the parameters only when a
    # module it finds is not the one the last run found; which parameters require a gradient
    # is read each run (a trainer may freeze the vision path between steps). A parameter added
    # to or removed from a module it found earlier, in place, is not seen: replace the module.
    def _vision_modules(self) -> _VisionModules:
        """The vision path's parent, modules and parameters, walked only when a module changed."""
        from megatron.core.utils import unwrap_model

        root = unwrap_model(self._chunks()[0])
        parent, name = self._vision_parent(self.vision, root)
        modules = (
            self._checked(self.vision, getattr(parent, name)),
            *(self._module_at(path, root) for path in self.vision_extra),
        )
        found = self._found
        if (
            found is not None
            and found.parent is parent
            and len(found.modules) == len(modules)
            and all(a is b for a, b in zip(found.modules, modules, strict=True))
        ):
            return found
        paths = (self.vision, *self.vision_extra)
        parameters = tuple(
            (path, n, p)
            for path, module in zip(paths, modules, strict=True)
            for n, p in module.named_parameters()
        )
        sharded = tuple(
            (f"{path}.{n}", p)
            for path, n, p in parameters
            if getattr(p, "tensor_model_parallel", False)
        )
        self._found = _VisionModules(parent, name, modules, parameters, sharded)
        return self._found

    def _sharding_refusals(self, found: _VisionModules) -> list[str]:
        """The declared ``tp_sharded_vision`` against megatron's marks on the vision parameters.

        NOTE [ Declared and detected TP sharding ]: megatron's (and TE's) tensor-parallel layers
        mark every parameter they shard with ``tensor_model_parallel=True`` and ``partition_dim``.
        A vision path with such a parameter runs TP collectives inside its forward: its TP peers
        must encode the same units together (``tp_sharded_vision=True``); declared replicated,
        each TP rank encodes different units through layers that exchange activations with the
        peer, and the gradients come out wrong (77-88% off in issue 22) or a rank dies. A path
        with no marked parameter declared sharded computes right but encodes every unit on every
        TP rank, TP times the work. Both are refused at TP > 1 (at TP = 1 the layouts coincide).
        """
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return []
        sharded = found.sharded
        if sharded and not self.tp_sharded_vision:
            name, param = sharded[0]
            return [
                f"the vision path is TP-sharded ({len(sharded)} parameters carry megatron's "
                f"tensor_model_parallel=True, e.g. {name} with partition_dim="
                f"{getattr(param, 'partition_dim', '?')}) but DedupVLMStep(tp_sharded_vision=False)"
                " declares it replicated; pass DedupVLMStep(tp_sharded_vision=True) and plan "
                "with MegatronLayout.encoder_topology(tp_sharded=True)"
            ]
        if not sharded and self.tp_sharded_vision:
            return [
                f"DedupVLMStep(tp_sharded_vision=True) but no parameter of the vision path "
                f"{sorted((self.vision, *self.vision_extra))} is TP-sharded (none carries tensor_model_parallel=True), so "
                "every TP rank would encode every unit; pass tp_sharded_vision=False and plan with "
                "MegatronLayout.encoder_topology() (if the path is sharded by layers megatron does "
                "not mark, mark them with tensor_parallel.set_tensor_model_parallel_attributes)"
            ]
        return []

    def _schedule(
        self,
        forward_step_func: Callable[..., object],
        data_iterator: Iterable[object],
        num_microbatches: int,
        schedule_kwargs: dict[str, object],
        **shape: int,
    ) -> list[object]:
        """Megatron's ``get_forward_backward_func()`` over this rank's model chunks."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return list(
            get_forward_backward_func()(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=self._chunks(),
                num_microbatches=num_microbatches,
                **shape,
                **schedule_kwargs,
            )
        )

    def _chunks(self) -> list[torch.nn.Module]:
        return list(self.model) if isinstance(self.model, list) else [self.model]

    def _feed(self, data_iterator: Iterable[object]) -> tuple[Iterable[object], CountingIterator]:
        """The schedule's data iterator(s), the vision chunk's counted (it says which micro-batch runs)."""
        if len(self._chunks()) == 1:
            feed = CountingIterator(iter(data_iterator))
            return feed, feed
        first, *rest = data_iterator  # one iterator per virtual-pipeline chunk
        feed = CountingIterator(iter(first))  # type: ignore[call-overload]
        return [feed, *rest], feed

    def _module_at(self, dotted: str, root: torch.nn.Module) -> torch.nn.Module:
        parent, name = self._vision_parent(dotted, root)
        return self._checked(dotted, getattr(parent, name))

    @staticmethod
    def _checked(dotted: str, module: object) -> torch.nn.Module:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"model attribute {dotted!r} is {type(module).__name__}, not a module")
        return module

    @staticmethod
    def _vision_parent(dotted: str, root: torch.nn.Module) -> tuple[torch.nn.Module, str]:
        """The module holding the attribute ``dotted`` of the unwrapped model ``root``, and its name."""
        *path, name = dotted.split(".")
        parent = root
        for part in path:
            parent = getattr(parent, part)
        if not hasattr(parent, name):
            raise AttributeError(
                f"the unwrapped model has no attribute {dotted!r}; pass DedupVLMStep(vision=..., "
                "vision_extra=...) the dotted paths of the modules that turn images into features"
            )
        return parent, name

    @contextlib.contextmanager
    def _serving(
        self, found: _VisionModules, lookup: torch.nn.Module
    ) -> Iterator[Callable[[], None]]:
        """Swap the lookup in for the vision path; yields ``restore`` (idempotent) for finalize.

        NOTE [ Finalize sees the vision path ]: the lookup serves the backbone's forward only.
        Megatron's ``finalize_model_grads`` walks the model's ``named_parameters`` to reduce the
        gradients DDP does not (over TP: params tagged ``sequence_parallel``, q/k layernorms,
        ``average_gradients_across_tp_domain``); with the lookup still in place it would skip
        every vision parameter. The finalize hook therefore restores the real vision path
        after the last backward, before finalize runs.
        """
        parent, name, original = found.parent, found.name, found.modules[0]
        setattr(parent, name, lookup)

        def restore() -> None:
            setattr(parent, name, original)

        try:
            yield restore
        finally:
            restore()

    def _encoder_group(self) -> dist.ProcessGroup | None:
        """Where encoding rows travel: the (first pipeline stage's) ranks, or this TP rank's DP x CP group if TP-sharded."""
        if not self.tp_sharded_vision:
            return stage_group()
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group(with_context_parallel=True)

    def _replicas_to_sum(self) -> int:
        """TP replicas whose vision gradients finalize must sum: the TP size if they encoded
        different units (replicated vision path), else 1 (NOTE [ Vision gradients under Megatron DDP ])."""
        if self.tp_sharded_vision:
            return 1
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_world_size()


@dataclass(frozen=True, slots=True)
class _VisionModules:
    """The vision path's modules as found in the model (NOTE [ The vision path found once ])."""

    parent: torch.nn.Module
    name: str
    """``getattr(parent, name)`` is ``modules[0]``, the path ``run`` swaps for its lookup."""
    modules: tuple[torch.nn.Module, ...]
    """``vision``, then every ``vision_extra`` module."""
    parameters: tuple[tuple[str, str, torch.nn.Parameter], ...]
    """(module path, name in the module, parameter) of every module's ``named_parameters``."""
    sharded: tuple[tuple[str, torch.nn.Parameter], ...]
    """(dotted name, parameter) of those megatron marked ``tensor_model_parallel``."""


@dataclass(frozen=True, slots=True)
class _VisionPath:
    """The first stage's vision path for one run: its config, modules and dedup encoder."""

    config: TransformerConfig
    found: _VisionModules
    dedup: DedupEncoder


@dataclass(slots=True)
class CountingIterator:
    """The schedule's data iterator: counts micro-batches so the lookup knows which one runs."""

    source: Iterator[object]
    count: int = 0

    def __iter__(self) -> CountingIterator:
        return self

    def __next__(self) -> object:
        item = next(self.source)
        self.count += 1
        return item


class _CachedFeatures(torch.nn.Module):
    """Stands in for the vision path: the current micro-batch's features from the dedup cache."""

    def __init__(self, dedup: DedupEncoder, feed: CountingIterator) -> None:
        super().__init__()
        self._dedup, self._feed = dedup, feed

    def forward(self, *unused: object, **unused_kw: object) -> torch.Tensor:
        if self._feed.count == 0:
            raise RuntimeError("the vision path ran before the forward step took its micro-batch")
        return self._dedup.features(self._feed.count - 1)


def _step_row(heard: Heard) -> Heard:
    """One rank's row of the encode handshake as ``agree_on_step`` reads its own (values
    ``num_microbatches, forward_only, plan, stage``; the problem only if the rank refused the
    step, not if its encoder failed): NOTE [ One handshake per step ]."""
    num_microbatches, refused = heard.extra[:2]
    step = (num_microbatches, int(not heard.keep_graph), heard.plan_word, 0)
    return Heard(heard.rank, heard.point, heard.turn, step, heard.problem if refused else "")
