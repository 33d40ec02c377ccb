"""The ordering contract with Megatron: the deferred encoder backward runs before finalize_model_grads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class DeferredBackward(Protocol):
    """Anything with a pending deferred backward (a ``DedupEncoder``)."""

    def backward(self) -> None: ...


@dataclass(slots=True)
class FinalizeWithDeferredBackward:
    """Drop-in ``config.finalize_model_grads_func`` that first runs the armed deferred encoder backward.

    NOTE [ Why before finalize ]: Megatron's schedule calls ``finalize_model_grads`` itself, after
    the last micro-batch. It finishes the DP gradient reduction (``finish_grad_sync``); with
    ``overlap_grad_reduce`` it asserts that every bucket's parameters got their gradients, so an
    encoder backward run after it is an error, and without overlap its gradients are simply never
    reduced. Wrapping the finalize function puts the deferred backward exactly between the last
    backbone backward and the reduction. Arm it once per mini-batch, before running the schedule::

        hook = FinalizeWithDeferredBackward(config.finalize_model_grads_func)
        config.finalize_model_grads_func = hook
        ...
        hook.arm(dedup)                       # per mini-batch, after dedup.encode(...)
        forward_backward_func(...)            # calls hook(...) -> dedup.backward(), then finalize
    """

    finalize: Callable[..., object]
    """The wrapped finalize function (Megatron's ``finalize_model_grads``)."""
    before_finalize: Callable[[], None] | None = None
    """Extra work after the deferred backward, before finalize (e.g. ``sync_encoder_grads``)."""
    _pending: DeferredBackward | None = None

    def arm(self, deferred: DeferredBackward) -> None:
        """Register the mini-batch whose deferred backward must run at the next finalize."""
        if self._pending is not None:
            raise RuntimeError(
                "a deferred encoder backward is already armed and has not run; "
                "the previous mini-batch never reached finalize_model_grads"
            )
        self._pending = deferred

    def __call__(self, *args: object, **kwargs: object) -> object:
        pending, self._pending = self._pending, None  # see NOTE [ Why before finalize ]
        if pending is not None:
            pending.backward()
            if self.before_finalize is not None:
                self.before_finalize()
        return self.finalize(*args, **kwargs)
