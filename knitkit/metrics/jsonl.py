"""JsonlObserver: one JSON line per step, for runs without TensorBoard (``pandas.read_json(lines=True)``)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

from knitkit.metrics.observer import ClosingObserver, checked


class JsonlObserver(ClosingObserver):
    """Appends ``{"step": n, "time": unix_s, "knitkit/...": value, ...}`` per step to ``path``.

    The file is created owner-only; ``append=False`` starts it afresh. Lines are written whole
    and flushed per step, so a crashed run keeps every step it finished.
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self.path = os.fspath(path)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        self._file = os.fdopen(os.open(self.path, flags, 0o600), "w", encoding="utf-8")

    def __call__(self, step: int, metrics: Mapping[str, float], /) -> None:
        line = {"step": step, "time": time.time(), **checked(metrics)}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, float]]:
    """The steps a ``JsonlObserver`` wrote, in order (``step`` and ``time`` included)."""
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]
