"""`knitkit replay`: table, JSON summary, plot, user traces, clear errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from knitkit.admission.replay import ProgressBar, preset, write_jsonl
from knitkit.cli import main


def test_replay_preset_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The JSON holds per-policy architectural staleness, violations and steps; the PNG exists."""
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(
        [
            "replay",
            "--preset",
            "paper4",
            "--policies",
            "linear,knittrans",
            "--minibatches",
            "4",
            "--train-batches",
            "8",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--quiet",
        ]
    )
    assert rc == 0
    summary = json.loads(out.read_text())
    for name in ("linear", "knittrans"):
        entry = summary["policies"][name]
        assert isinstance(entry["architectural_staleness"], float)
        assert entry["violations"] == 0 and entry["steps"] == 6
    assert png.stat().st_size > 10_000
    assert "knittrans" in capsys.readouterr().out


def test_replay_user_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A JSONL trace replays with the given quotas."""
    chosen = preset("paper4")
    path = tmp_path / "t.jsonl"
    write_jsonl(chosen.trace(chosen.settings.with_(train_batches=10)), path)
    rc = main(
        [
            "replay",
            "--trace",
            str(path),
            "--quotas",
            "A=0.2,B=0.2,C=0.2,D=0.2",
            "--policies",
            "streaming,knittrans",
            "--train-batches",
            "8",
            "--quiet",
        ]
    )
    assert rc == 0
    assert "streaming" in capsys.readouterr().out


def test_unknown_policy_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown policy exits 2 and names the policy and the choices."""
    assert main(["replay", "--policies", "fifo", "--train-batches", "8", "--quiet"]) == 2
    assert "['fifo']" in capsys.readouterr().err


def test_bad_quota_text_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A malformed --quotas item exits 2 and shows the expected form."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"source": "A", "sample_id": "x", "duration_s": 3}\n')
    assert main(["replay", "--trace", str(path), "--quotas", "A0.5", "--quiet"]) == 2
    assert "expected SOURCE=RATIO" in capsys.readouterr().err


def test_progress_bar_draws_when_forced() -> None:
    """The progress bar writes a single carriage-returned line and ends with a newline."""
    stream = io.StringIO()
    bar = ProgressBar(3, "replay", stream=stream, force=True)
    for _ in range(3):
        bar.advance()
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("3/3\n")
