"""Input checks shared by the admission library: whole counts, ratios and names, refused by name."""

from __future__ import annotations

import math
from numbers import Integral, Real


def is_whole(value: object) -> bool:
    """True for an integer (Python or numpy), never for a bool or a float such as 2.0 or 2.5."""
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, bool))


def whole(value: object, name: str, *, minimum: int | None = 0) -> int:
    """``value`` as an int if it is a whole number >= ``minimum``; else ValueError naming ``name``."""
    if not is_whole(value):
        raise ValueError(f"{name}={value!r}: give a whole number")
    number = int(value)  # type: ignore[call-overload]
    if minimum is not None and number < minimum:
        raise ValueError(f"{name}={number}: must be >= {minimum}")
    return number


def ratio(value: object, name: str) -> float:
    """``value`` as a float if it is a real number in [0, 1]; else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name}={value!r}: give a number in [0, 1]")
    number = float(value)
    if not 0.0 <= number <= 1.0:  # NaN fails this too
        raise ValueError(f"{name}={number} is outside [0, 1]")
    return number


def finite(value: object, name: str, *, positive: bool = False) -> float:
    """``value`` as a finite float (> 0 if ``positive``, else >= 0); else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name}={value!r}: give a number")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(f"{name}={number}: give a finite number {'> 0' if positive else '>= 0'}")
    return number


def name(value: object, what: str) -> str:
    """``value`` if it is a non-empty string; else ValueError naming ``what``."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what}={value!r}: give a non-empty string")
    return value


def implements(value: object, protocol: type, what: str) -> None:
    """ValueError naming ``what`` and the missing members unless ``value`` has every member of
    the runtime-checkable ``protocol`` (an ``AttributeError`` deep inside admission otherwise)."""
    if not isinstance(value, protocol):
        members = [m for m in vars(protocol) if not m.startswith("_")]
        missing = [m for m in members if not hasattr(value, m)]
        raise ValueError(
            f"{what}={value!r} is not a {protocol.__name__}: it lacks {', '.join(missing)} "
            f"(a {protocol.__name__} has {', '.join(members)})"
        )
