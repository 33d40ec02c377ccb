"""Counting sleeps from /proc: tests that bound wakes count each task's voluntary context switches
(one per sleep that ended), which load does not blur (the project's rule against timed unit tests)."""

from __future__ import annotations

import glob


def voluntary_switches(pattern: str) -> dict[str, int]:
    """Voluntary context switches so far of each task whose /proc status file matches the glob
    ``pattern`` (e.g. ``/proc/<pid>/task/*/status``), by status path; a task that exits between
    the listing and its read is left out."""
    switches = {}
    for status in glob.glob(pattern):
        try:
            with open(status) as lines:
                switches[status] = next(
                    int(s.split()[1]) for s in lines if s.startswith("voluntary_ctxt_switches:")
                )
        except FileNotFoundError:
            continue
    return switches


def total_voluntary_switches(pattern: str) -> int:
    """The sum of ``voluntary_switches(pattern)``: every matching task's sleeps that ended."""
    return sum(voluntary_switches(pattern).values())
