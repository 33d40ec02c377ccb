"""The observer seam: a callable taking one step's flat ``knitkit/<part>/<figure>`` -> float figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Protocol, TypeVar

_Self = TypeVar("_Self", bound="ClosingObserver")

PREFIX = "knitkit/"
"""Every figure's name starts with it: ``knitkit/<part>/<figure>`` (e.g. ``knitkit/storage/units_live``)."""

# NOTE [ Parts are pulled, observers are pushed ]:
# Each part's run-holding class has ``metrics() -> dict[str, float]``: a flat snapshot, names
# ``knitkit/<part>/<figure>``, cumulative counters marked as such in its docstring. Parts never
# import this package; the glue that owns the loop (the demo, a driver, an example, the user's
# trainer) pulls the snapshots once per step, merges them (``merge``) and pushes the result to
# an observer. That keeps the parts free of logging dependencies and threads, keeps the time a
# figure is taken under the caller's control (after the step, on the rank that owns it), and
# makes the observer one function: W&B is ``lambda step, m: wandb.log(dict(m), step=step)``,
# MLflow ``lambda step, m: mlflow.log_metrics(dict(m), step=step)``. Names are flat and
# slash-separated because that is what TensorBoard, W&B and MLflow all group by. Counters stay
# cumulative (as torch's profiler and Megatron's ``num_floating_point_operations_so_far`` do):
# a cumulative series survives a dropped step and a resumed run, and per-step rates are a
# derivative any dashboard draws; per-step figures (the last mini-batch's size) say so in
# their docstring.


class MetricsObserver(Protocol):
    """Receives one step's figures; called from one thread, once per step, steps increasing."""

    def __call__(self, step: int, metrics: Mapping[str, float], /) -> None: ...


def checked(metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` as plain floats, after checking every name is namespaced and every value is a number."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name.startswith(PREFIX) or name.endswith("/"):
            raise ValueError(
                f"metric name {name!r}: name figures '{PREFIX}<part>/<figure>', e.g. "
                "'knitkit/storage/units_live'"
            )
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(
                f"metric {name!r} = {value!r} ({type(value).__name__}): values are plain numbers; "
                "convert counts and tensors with float()"
            )
        out[name] = float(value)
    return out


def merge(*snapshots: Mapping[str, float]) -> dict[str, float]:
    """One step's figures from several ``metrics()`` snapshots; a name given twice is an error."""
    out: dict[str, float] = {}
    for snapshot in snapshots:
        for name, value in checked(snapshot).items():
            if name in out:
                raise ValueError(
                    f"metric {name!r} comes from two sources; give each object its own "
                    "'knitkit/<part>/' namespace or rename one figure before merging"
                )
            out[name] = value
    return out


def sum_over(snapshots: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Figures of several ranks (or objects of one kind) added up name by name.

    For counters and seconds, whose sum is the job's total; a name missing on some rank counts
    as 0 there. NaN stays NaN.
    """
    out: dict[str, float] = {}
    for snapshot in snapshots:
        for name, value in checked(snapshot).items():
            out[name] = out.get(name, 0.0) + value
    return out


class ClosingObserver:
    """Base of observers that hold a file: ``close`` releases it, ``with observer:`` closes on exit."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class FanOut:
    """Pushes each step to several observers, in order; it owns none of them (close them yourself)."""

    __slots__ = ("observers",)

    def __init__(self, *observers: MetricsObserver) -> None:
        self.observers = observers

    def __call__(self, step: int, metrics: Mapping[str, float], /) -> None:
        figures = checked(metrics)
        for observer in self.observers:
            observer(step, figures)
