"""Quota bounds in whole GRPO groups: the one place a bound is rounded to what groups can meet."""

from __future__ import annotations

from dataclasses import dataclass

# NOTE [ Bounds in whole groups ]: with ``group_size = g > 1`` admission moves whole GRPO groups,
# so a train batch holds a multiple of g trajectories of each source: a lower bound of 12 is met
# only at 16, an upper bound of 12 stops at 8. Every decision that compares counts with a bound
# (the construction check, the guard's precheck and its check on a candidate, the selection's
# fill, ``shortfall()``) must use the rounded bounds; one site that compared with the raw upper
# bound (``shortfall()``: 16 admitted, ready a 8 / b 8 / c 8 with b, c <= 12 of 32 "could fill")
# told a dynamic-sampling loop nothing was missing while no mini-batch could ever be admitted
# (issue 30). So the rounding lives here, once, and every site asks ``GroupBounds``.


@dataclass(frozen=True, slots=True)
class GroupBounds:
    """A source quota's bounds as a train batch of whole GRPO groups can meet them."""

    lower: int
    """The lower bound rounded up to whole groups: the fewest trajectories that meet it."""
    upper: int | None
    """The upper bound rounded down to whole groups: the most a train batch can hold (None:
    unbounded)."""

    @classmethod
    def of(cls, lower: int, upper: int | None, group_size: int) -> GroupBounds:
        """Bounds ``lower`` / ``upper`` (in trajectories) for groups of ``group_size``."""
        return cls(
            -(-lower // group_size) * group_size,
            None if upper is None else upper // group_size * group_size,
        )

    def deficit(self, count: int) -> int:
        """Trajectories the lower bound still misses once ``count`` are in."""
        return max(0, self.lower - count)

    def room(self, count: int) -> int | None:
        """Trajectories the upper bound still lets in once ``count`` are in (None: no bound)."""
        return None if self.upper is None else max(0, self.upper - count)

    def usable(self, count: int) -> int:
        """How many of ``count`` trajectories a train batch can hold under the upper bound."""
        return count if self.upper is None else min(count, self.upper)
