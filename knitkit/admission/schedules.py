"""Progressive-target schedules: the coefficients alpha_{i,1..n} of paper eq. (3)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class Schedule(Protocol):
    """Gives ``alpha_1..alpha_n`` for a train batch of ``n`` mini-batches; validated by ``coefficients``."""

    def alphas(self, n: int) -> tuple[float, ...]: ...


def coefficients(schedule: Schedule, n: int, *, name: str = "schedule") -> tuple[float, ...]:
    """``schedule.alphas(n)``, checked: n values in [0, 1], non-decreasing, ending at exactly 1."""
    values = tuple(float(a) for a in schedule.alphas(n))
    if len(values) != n:
        raise ValueError(
            f"{name}: {len(values)} coefficients for {n} mini-batches; give one per mini-batch"
        )
    for t, value in enumerate(values, start=1):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: alpha_{t}={value} is outside [0, 1]")
        if t > 1 and value < values[t - 2]:
            raise ValueError(
                f"{name}: alpha_{t}={value} < alpha_{t - 1}={values[t - 2]}; coefficients must not decrease"
            )
    if values[-1] != 1.0:
        raise ValueError(
            f"{name}: alpha_{n}={values[-1]}; the last coefficient must be 1 (the final quota)"
        )
    return values


@dataclass(frozen=True, slots=True)
class LinearSchedule:
    """alpha_t = t / n: every target grows in proportion to admission progress (the paper's strawman)."""

    def alphas(self, n: int) -> tuple[float, ...]:
        return tuple(t / n for t in range(1, n + 1))


@dataclass(frozen=True, slots=True)
class RelaxedSchedule:
    """alpha_t = 0 for the first ``hold`` share of mini-batches, then linear up to 1.

    With the default ``hold=0.5`` and n=4 this is (0, 0, 0.5, 1): the paper's Figure 1 targets
    (0, 0, 2, 4) instead of the linear (1, 2, 3, 4).
    """

    hold: float = 0.5
    """Share of the train batch admitted before source targets start to rise, in [0, 1)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.hold < 1.0:
            raise ValueError(f"RelaxedSchedule.hold={self.hold}; use a value in [0, 1)")

    def alphas(self, n: int) -> tuple[float, ...]:
        return tuple(
            min(1.0, max(0.0, (t / n - self.hold) / (1.0 - self.hold))) for t in range(1, n + 1)
        )


@dataclass(frozen=True, slots=True)
class FinalOnlySchedule:
    """alpha = (0, ..., 0, 1): only the final admission waits for the target (guards do the rest)."""

    def alphas(self, n: int) -> tuple[float, ...]:
        return (0.0,) * (n - 1) + (1.0,)


@dataclass(frozen=True, slots=True)
class BarrierSchedule:
    """alpha = (1, ..., 1): every mini-batch waits for the final target (train-batch admission)."""

    def alphas(self, n: int) -> tuple[float, ...]:
        return (1.0,) * n


@dataclass(frozen=True, slots=True)
class ExplicitSchedule:
    """User-given coefficients, one per mini-batch (validated when the controller is built)."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> ExplicitSchedule:
        return cls(tuple(float(v) for v in values))

    def alphas(self, n: int) -> tuple[float, ...]:
        return self.values
