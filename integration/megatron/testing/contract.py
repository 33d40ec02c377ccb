"""What the check needs of the user's callables, checked before any rank starts work.

The contract (integration/megatron/README.md, "Check your own model"): ``provider()`` takes no
argument and returns this rank's Megatron DDP model (or its virtual-pipeline chunks);
``forward_step(data_iterator, model)`` returns ``(output, loss_func)``; ``trajectories`` is a
non-empty sequence of ``Trajectory`` or a function of no argument returning one. Each check names
the callable (and its command-line flag) and says what is wrong with it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from knitkit.integration.megatron.testing.subject import Ref, VLMUnderTest, resolve
from knitkit.storage import Trajectory


class ContractError(TypeError):
    """A callable of the check (provider, forward step, trajectories, ...) breaks its contract."""


ARGUMENTS: dict[str, tuple[str, ...]] = {
    "provider": (),
    "forward_step": ("data_iterator", "model"),
    "forward_only_step": ("data_iterator", "model"),
    "reference_forward_step": ("data_iterator", "model"),
    "encoder": ("model",),
    "to_batch": ("micro_batch",),
    "reference_batches": ("micro_batches", "batches", "load"),
}
"""The positional arguments the check calls each ``VLMUnderTest`` callable with."""


def flag(name: str) -> str:
    """The field's name and its ``knitkit check-equivalence`` flag, e.g. ``forward_step (--forward-step)``."""
    return f"{name} (--{name.replace('_', '-')})"


def check_contract(subject: VLMUnderTest, trajectories: Ref[object]) -> Sequence[Trajectory]:
    """The trajectories, once every callable of ``subject`` is known to take its arguments and
    ``trajectories`` to be a mini-batch; else ``ContractError`` naming every one that is not."""
    problems = []
    for name, arguments in ARGUMENTS.items():
        ref = getattr(subject, name)
        if ref is not None:
            problems += _callable_problems(name, ref, arguments)
    try:
        made = trajectories_of(trajectories)
    except ContractError as error:
        problems.append(str(error))
    if problems:
        raise ContractError("\n".join(problems))
    return made


def trajectories_of(ref: Ref[object]) -> Sequence[Trajectory]:
    """The mini-batch ``ref`` names: a sequence of ``Trajectory``, or a function returning one."""
    problems = _callable_problems("trajectories", ref, ())
    if problems and not problems[0].endswith("not callable"):  # a plain list is not called
        raise ContractError("\n".join(problems))
    value = resolve(ref)
    made = value() if callable(value) else value
    where = f"{flag('trajectories')} {_shown(ref)}"
    if not isinstance(made, Sequence) or isinstance(made, str | bytes) or not made:
        raise ContractError(
            f"{where} gave {_kind(made)}; it must be (or return) a non-empty list of "
            "knitkit.storage.Trajectory, the mini-batch"
        )
    wrong = [i for i, t in enumerate(made) if not isinstance(t, Trajectory)]
    if wrong:
        raise ContractError(
            f"{where}: item {wrong[0]} is {_kind(made[wrong[0]])}, not a knitkit.storage."
            f"Trajectory ({len(wrong)} of {len(made)} items are not)"
        )
    if not any(t.multimodal for t in made):
        raise ContractError(
            f"{where}: none of its {len(made)} trajectories has a multimodal input; the check "
            "compares the vision path's gradients, so give some trajectories images "
            "(Trajectory(..., multimodal=(MultimodalInput(...),)))"
        )
    return made


def checked_model(ref: Ref[object], built: object) -> list[torch.nn.Module]:
    """The provider's return as a list of Megatron DDP chunks, or a ``ContractError`` saying why not."""
    chunks: list[torch.nn.Module] = []
    for chunk in list(built) if isinstance(built, list | tuple) else [built]:
        if not isinstance(chunk, torch.nn.Module) or not hasattr(chunk, "zero_grad_buffer"):
            raise ContractError(
                f"{flag('provider')} {_shown(ref)} returned {_kind(chunk)}; it must return this "
                "rank's model wrapped in megatron's DistributedDataParallel (or the list of its "
                "virtual-pipeline chunks), with config.finalize_model_grads_func and "
                "config.no_sync_func set as megatron's training loop sets them"
            )
        chunks.append(chunk)
    if not chunks:
        raise ContractError(f"{flag('provider')} {_shown(ref)} returned an empty list")
    return chunks


def checked_step(name: str, ref: Ref[Callable[..., Any]]) -> Callable[..., Any]:
    """``ref``'s forward step, raising ``ContractError`` when a call returns other than
    ``(output tensor, loss_func)``."""
    step = resolve(ref)

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
        out = step(data_iterator, model)
        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and isinstance(out[0], torch.Tensor)
            and callable(out[1])
        ):
            raise ContractError(
                f"{flag(name)} {_shown(ref)} returned {_kind(out)}; megatron's schedule needs "
                "(output tensor, loss_func), loss_func(output) returning (loss, num_tokens, "
                "{name: tensor}) or (loss, {name: tensor})"
            )
        return out

    return forward_step


def _callable_problems(name: str, ref: Ref[object], arguments: tuple[str, ...]) -> list[str]:
    """Why ``ref`` cannot be called with ``arguments`` positionally (empty if it can)."""
    try:
        value = resolve(ref)
    except (ImportError, AttributeError, ValueError) as error:
        return [f"{flag(name)}: {error}"]
    where = f"{flag(name)} {_shown(ref)}"
    if not callable(value):
        return [f"{where} is {_kind(value)}, not callable"]
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return []
    try:
        signature.bind(*arguments)
    except TypeError as error:
        return [
            f"{where} cannot be called as {name}({', '.join(arguments)}): {error}; wrap it in a "
            "module-level function (or functools.partial) that takes exactly those arguments "
            "and passes your own"
        ]
    return []


def _shown(ref: Ref[object]) -> str:
    return repr(ref) if isinstance(ref, str) else f"{getattr(ref, '__qualname__', ref)!r}"


def _kind(value: object) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
