"""The user's model as the equivalence check builds and runs it; parts may be named by import path."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar

import torch

from knitkit.microbatch_iter import MicroBatch
from knitkit.storage import MicroBatchPlan
from knitkit.types import UnitKey

T = TypeVar("T")
Ref: TypeAlias = T | str
"""A value, or the import path ``"package.module:attribute"`` that names it (resolved on each rank)."""

ForwardStep = Callable[[Iterator[Any], torch.nn.Module], tuple[torch.Tensor, Callable[..., Any]]]
"""Megatron's ``forward_step_func(data_iterator, model) -> (output, loss_func)``."""
Provider = Callable[[], torch.nn.Module | list[torch.nn.Module]]
"""Builds this rank's model: a Megatron DDP chunk (or the virtual-pipeline chunks, in order) with
``config.finalize_model_grads_func`` and ``no_sync_func`` set as megatron's training loop sets them."""
UnitEncoder = Callable[[torch.nn.Module], Callable[[torch.Tensor], torch.Tensor]]
"""``encoder(model)`` -> a function from one unit's stored input (a tensor on the model's device)
to its feature rows ``[placeholder tokens, hidden]``, run with that model's vision path."""


class ReferenceBatches(Protocol):
    """The unwrapped model's own micro-batches, for a reference whose inputs differ from the wrap's.

    Called per mini-batch with this rank's planned micro-batches, the wrap's batches (same order)
    and ``load(key)`` (a unit's stored input on the device); yields one batch per micro-batch,
    e.g. ``dict(batch, images=[load(s.key) ... for s in feature_slices(plan)])`` or LLaVA's own
    text-length inputs.
    """

    def __call__(
        self,
        micro_batches: Sequence[MicroBatchPlan],
        batches: Iterable[Mapping[str, object]],
        load: Callable[[UnitKey], torch.Tensor],
    ) -> Iterable[object]: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class VLMUnderTest:
    """What the check needs of the user's Megatron VLM: the same things ``DedupVLMStep`` needs, plus a provider.

    Fields typed ``Ref`` take the object or its import path (``"my_pkg.model:provider"``); paths
    keep the value picklable for spawned ranks and are how ``knitkit check-equivalence`` names them.
    """

    provider: Ref[Provider]
    """Called with no argument twice (wrapped and reference model) after seeding torch and
    megatron's RNG alike; both builds must come out with equal weights (checked)."""
    forward_step: Ref[ForwardStep]
    """The forward step of the training pass, unchanged for the wrap."""
    vision: str = "vision"
    """Dotted path of the vision path in the unwrapped model (``DedupVLMStep.vision``)."""
    vision_extra: tuple[str, ...] = ()
    """Further vision modules the deferred backward reaches (``DedupVLMStep.vision_extra``)."""
    tp_sharded_vision: bool = False
    """The vision path is TP-sharded (``DedupVLMStep.tp_sharded_vision``)."""
    encoder: Ref[UnitEncoder] | None = None
    """The wrap's per-unit encoder; default: the vision module's ``encode(x)`` if it has one, else
    the module itself. The reference never runs it (NOTE [ Re-encoding reference ])."""
    to_batch: Ref[Callable[[MicroBatch], Mapping[str, object]]] | None = None
    """``megatron_batches``' ``to_batch``; default ``batch_for(te_available(), cp)``."""
    forward_only_step: Ref[ForwardStep] | None = None
    """The forward step of the forward-only pass (old / reference log-probs) of both models (the
    reference's on its own batches); default ``forward_step``. Every tensor of its loss dicts is
    compared."""
    reference_batches: Ref[ReferenceBatches] | None = None
    """Default ``None``: the reference runs the wrap's batches plus ``images``, the pieces each
    micro-batch consumes, through the model's own forward and vision path (``reference.with_images``,
    NOTE [ Re-encoding reference ]); name your own for a model that takes images otherwise."""
    reference_forward_step: Ref[ForwardStep] | None = None
    """The reference's training forward step (default ``forward_step``), e.g. for
    ``reference_batches`` of another form; forward-only passes run ``forward_only_step``."""
    token_fields: tuple[str, ...] | None = None
    """Per-token fields to plan; default every per-token field of the first trajectory."""


def resolve(ref: Ref[T]) -> T:
    """The object an import path ``"package.module:attribute.attribute"`` names (values pass through)."""
    if not isinstance(ref, str):
        return ref
    module_name, _, attribute = ref.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{ref!r} is not an import path; write it as 'package.module:attribute'")
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(
            f"cannot import {module_name!r} for {ref!r} ({error}); put its folder on PYTHONPATH "
            "(or pass python_path=...) on every rank"
        ) from error
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise AttributeError(
                f"{module_name!r} has no attribute {attribute!r} ({ref!r})"
            ) from None
    return value


def import_path(value: object) -> str:
    """``"module:qualname"`` of a module-level function or class (refuses lambdas and closures)."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if not module or not qualname or "<" in qualname:
        raise ValueError(
            f"{value!r} has no import path; define it at module level or pass 'module:attribute'"
        )
    return f"{module}:{qualname}"
