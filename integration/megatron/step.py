"""The wrapped Megatron VLM train step: deduplicated encoding around megatron-core's forward-backward schedule."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from knitkit.encoder_dedup import (
    DedupEncoder,
    EncodeFn,
    FinalizeWithDeferredBackward,
    ProcessGroupTransport,
    RankRoute,
)
from knitkit.integration.megatron.grads import DeferredVisionBackward, finalize_then_sum


@dataclass(slots=True)
class DedupVLMStep:
    """Runs one mini-batch of a Megatron VLM with every unique multimodal input encoded once.

    The user's model, forward step and loss stay as they are. For the length of ``run`` the vision
    path (encoder + projector, at the dotted attribute ``vision`` of the unwrapped model) is
    replaced by a lookup that hands each backbone micro-batch its cached features as
    ``detach().requires_grad_()`` leaves, and ``config.finalize_model_grads_func`` is wrapped so
    the one deferred encoder backward runs after the last micro-batch's backward and before
    Megatron finishes its gradient reduction, whatever ``overlap_grad_reduce`` is.

    See NOTE [vision gradients under Megatron DDP] in ``grads.py`` for how encoder gradients
    reach every replica.
    """

    model: torch.nn.Module
    """The (DDP-wrapped) model chunk handed to the schedule."""
    vision: str = "vision"
    """Dotted path of the vision path inside the unwrapped model; its output rows must be the
    features of the micro-batch's placeholder tokens, in order."""
    tp_sharded_vision: bool = False
    """True when the vision path is itself TP-sharded (e.g. megatron's ``MultimodalProjector``):
    TP peers then encode together, rows travel in megatron's DP x CP group and no TP sum is
    needed. Plan with ``MegatronLayout.encoder_topology(tp_sharded=True)`` to match."""
    last_encoded_units: int = field(default=0, init=False)
    """Unique units this rank encoded in the last ``run``."""

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
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.utils import get_model_config

        if len(route.micro_batch_index) != num_microbatches:
            raise ValueError(
                f"route covers {len(route.micro_batch_index)} backbone micro-batches but "
                f"num_microbatches={num_microbatches}; route and data must come from the same plan"
            )
        config = get_model_config(self.model)
        original = config.finalize_model_grads_func
        if original is None:
            raise ValueError(
                "config.finalize_model_grads_func is None; set it to "
                "megatron.core.distributed.finalize_model_grads as megatron's training loop does"
            )
        if schedule_kwargs.get("forward_only"):
            raise ValueError(
                "DedupVLMStep runs training steps; for forward_only run the unwrapped step"
            )
        transport = ProcessGroupTransport(self._encoder_group())
        if len(route.forward.send_counts) != transport.world_size:
            raise ValueError(
                f"route spans {len(route.forward.send_counts)} ranks but the encoder group has "
                f"{transport.world_size}; plan with encoder_topology(tp_sharded="
                f"{self.tp_sharded_vision}) to match DedupVLMStep(tp_sharded_vision=...)"
            )
        vision = self._vision_module()
        params = tuple(p for p in vision.parameters() if p.requires_grad)
        dedup = DedupEncoder(
            route,
            transport,
            hidden=config.hidden_size,
            dtype=config.params_dtype,
            device=_device(),
        )
        dedup.encode(encode_fn)
        self.last_encoded_units = dedup.encoded_units
        hook = FinalizeWithDeferredBackward(
            functools.partial(finalize_then_sum, original, params, self._sum_group())
        )
        hook.arm(DeferredVisionBackward(dedup, params))
        feed = _CountingIterator(iter(data_iterator))
        config.finalize_model_grads_func = hook
        try:
            with self._serving(_CachedFeatures(dedup, feed)):
                out = get_forward_backward_func()(
                    forward_step_func=forward_step_func,
                    data_iterator=feed,
                    model=[self.model],
                    num_microbatches=num_microbatches,
                    seq_length=seq_length,
                    micro_batch_size=micro_batch_size,
                    **schedule_kwargs,
                )
        finally:
            config.finalize_model_grads_func = original
        if feed.count != num_microbatches:
            raise RuntimeError(
                f"the forward step took {feed.count} micro-batches for num_microbatches="
                f"{num_microbatches}; it must call next(data_iterator) exactly once per call"
            )
        return list(out)

    def _vision_module(self) -> torch.nn.Module:
        parent, name = self._vision_parent()
        module = getattr(parent, name)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"model attribute {self.vision!r} is {type(module).__name__}, not a module"
            )
        return module

    def _vision_parent(self) -> tuple[torch.nn.Module, str]:
        from megatron.core.utils import unwrap_model

        *path, name = self.vision.split(".")
        parent = unwrap_model(self.model)
        for part in path:
            parent = getattr(parent, part)
        if not hasattr(parent, name):
            raise AttributeError(
                f"the unwrapped model has no attribute {self.vision!r}; pass DedupVLMStep(vision=...) "
                "the dotted path of the module that turns images into features"
            )
        return parent, name

    @contextlib.contextmanager
    def _serving(self, lookup: torch.nn.Module) -> Iterator[None]:
        parent, name = self._vision_parent()
        original = getattr(parent, name)
        setattr(parent, name, lookup)
        try:
            yield
        finally:
            setattr(parent, name, original)

    def _encoder_group(self) -> dist.ProcessGroup | None:
        """Where encoding rows travel: the world, or this TP rank's DP x CP group if TP-sharded."""
        if not self.tp_sharded_vision:
            return None
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group(with_context_parallel=True)

    def _sum_group(self) -> dist.ProcessGroup | None:
        """Where vision gradients are summed after finalize: TP if replicas encoded different units."""
        if self.tp_sharded_vision:
            return None
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()


@dataclass(slots=True)
class _CountingIterator:
    """The schedule's data iterator: counts micro-batches so the lookup knows which one runs."""

    source: Iterator[object]
    count: int = 0

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> object:
        item = next(self.source)
        self.count += 1
        return item


class _CachedFeatures(torch.nn.Module):
    """Stands in for the vision path: the current micro-batch's features from the dedup cache."""

    def __init__(self, dedup: DedupEncoder, feed: _CountingIterator) -> None:
        super().__init__()
        self._dedup, self._feed = dedup, feed

    def forward(self, *unused: object, **unused_kw: object) -> torch.Tensor:
        if self._feed.count == 0:
            raise RuntimeError("the vision path ran before the forward step took its micro-batch")
        return self._dedup.features(self._feed.count - 1)


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
