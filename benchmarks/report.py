"""The end of a benchmark run: the load average at the end, the table, what was skipped, the JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping


def finish(
    figures: dict[str, float],
    table: Callable[[dict[str, float]], None],
    skipped: Mapping[str, str],
    json_path: str | None,
) -> None:
    """Add ``loadavg_1m_at_end`` to ``figures``, print ``table(figures)`` and a line per skipped
    part, and write the figures and the reasons (``skipped``: key -> reason) as one flat JSON
    object to ``json_path`` (``--json``; none: no file)."""
    figures["loadavg_1m_at_end"] = os.getloadavg()[0]
    table(figures)
    for reason in skipped.values():
        print(f"skipped: {reason}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({**figures, **skipped}, f, indent=1, sort_keys=True)
