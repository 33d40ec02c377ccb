"""The engine sliced-read benchmark skips an engine that cannot load, naming why."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from knitkit.integration import sliced_read


def test_an_engine_that_cannot_load_is_skipped_with_its_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where Mooncake's modules do not import (no wheel, or a system library missing), the run
    exits 0, says it skipped Mooncake and why, and the JSON carries the reason, not a crash."""
    for name in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mooncake", None)  # what a missing wheel looks like
    out = tmp_path / "figures.json"
    assert sliced_read.main(["--engines", "mooncake", "--quick", "--json", str(out)]) == 0
    reason = json.loads(out.read_text())["sliced_read.mooncake.skipped"]
    assert "mooncake cannot load" in reason and "mooncake.engine" in reason
    assert "skipped" in capsys.readouterr().out
