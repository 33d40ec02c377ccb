"""Loaders for the recorded SGLang ``/generate`` payloads under ``data/sglang/`` (see its README)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "sglang"


def load(name: str) -> dict[str, Any]:
    """One recorded exchange file, as JSON."""
    with open(DATA / name) as file:
        return json.load(file)
