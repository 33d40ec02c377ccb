"""Progressive-target schedules: shapes and validation."""

from __future__ import annotations

import pytest

from knitkit.admission.schedules import (
    BarrierSchedule,
    ExplicitSchedule,
    FinalOnlySchedule,
    LinearSchedule,
    RelaxedSchedule,
    coefficients,
)


def test_builtin_shapes() -> None:
    """Linear is t/n; relaxed at n=4 is the paper's (0, 0, 1/2, 1); every schedule ends at 1."""
    assert coefficients(LinearSchedule(), 4) == (0.25, 0.5, 0.75, 1.0)
    assert coefficients(RelaxedSchedule(), 4) == (0.0, 0.0, 0.5, 1.0)
    assert coefficients(FinalOnlySchedule(), 3) == (0.0, 0.0, 1.0)
    assert coefficients(BarrierSchedule(), 2) == (1.0, 1.0)
    for n in (1, 2, 5, 8):
        for schedule in (LinearSchedule(), RelaxedSchedule(0.3), FinalOnlySchedule()):
            values = coefficients(schedule, n)
            assert values[-1] == 1.0 and list(values) == sorted(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ((0.0, 0.6, 0.5, 1.0), "must not decrease"),
        ((0.0, 0.2, 0.5, 0.9), "last coefficient must be 1"),
        ((0.0, 1.5, 1.5, 1.0), "outside"),
        ((0.5, 1.0), "one per mini-batch"),
    ],
)
def test_bad_user_schedule_is_rejected(values: tuple[float, ...], message: str) -> None:
    """User coefficient lists must be n values, non-decreasing, within [0, 1], ending at 1."""
    with pytest.raises(ValueError, match=message):
        coefficients(ExplicitSchedule.of(values), 4)


def test_relaxed_hold_must_be_a_share() -> None:
    """A relaxed schedule's hold share outside [0, 1) is refused at construction."""
    with pytest.raises(ValueError, match="hold"):
        RelaxedSchedule(1.0)
