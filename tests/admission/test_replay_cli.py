"""`knitkit replay`: table, JSON summary, plot, user traces, clear errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from knitkit.admission.replay import ProgressBar, ReplaySettings, preset, write_jsonl
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


def test_user_trace_with_quotas_file_runs_without_python(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's JSONL trace replays through the CLI with a quotas file (counts, an upper bound,
    a completion quota), issue shares, pipeline knobs and `--train-batches auto`; the JSON
    settings block holds every replay setting, the CSV one row per policy with per-source
    staleness."""
    chosen = preset("paper4")
    trace, quotas = tmp_path / "t.jsonl", tmp_path / "q.json"
    write_jsonl(chosen.trace(chosen.settings.with_(train_batches=8, train_batch_size=64)), trace)
    quotas.write_text(
        json.dumps(
            {
                "quotas": {"A": {"min_count": 12}, "D": {"min_ratio": 0.2, "max_ratio": 0.4}},
                "completion_quota": 0.5,
            }
        )
    )
    out, table = tmp_path / "r.json", tmp_path / "r.csv"
    argv = ["replay", "--trace", str(trace), "--quotas-file", str(quotas)]
    argv += ["--train-batch-size", "64", "--issue-shares", "A=0.2,B=0.2,C=0.2,D=0.4"]
    argv += ["--oversample", "0.2", "--slots", "48", "--source-cap", "1.5", "--max-staleness", "3"]
    argv += ["--train-batches", "auto", "--policies", "linear,adaptive", "--quiet"]
    assert main([*argv, "--json", str(out), "--csv", str(table)]) == 0
    summary = json.loads(out.read_text())
    block = summary["settings"]
    assert set(ReplaySettings.__dataclass_fields__) <= set(block)
    assert (block["trace"], block["preset"]) == (str(trace), None)
    assert block["quotas"] == {"A": {"lower": 12, "upper": None}, "D": {"lower": 13, "upper": 25}}
    assert (block["completion_quota"], block["rollout_slots"], block["max_staleness"]) == (
        0.5,
        48,
        3,
    )
    assert block["train_batches"] >= 4
    for entry in summary["policies"].values():
        assert entry["violations"] == 0
        assert set(entry["staleness_per_source"]) == {"A", "B", "C", "D"}
    rows = table.read_text().splitlines()
    assert rows[0].startswith("policy,architectural_staleness") and "staleness.D" in rows[0]
    assert len(rows) == 3
    assert "drift" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--quotas", "A=0.2", "--quotas-file", "q.json"], "use one"),
        (["--seed", "3"], "--seed draws a preset's trace"),
        (["--train-batches", "auto", "--train-batch-size", "4096"], "trace too short"),
        (["--train-batches", "many"], "'many': give a whole number or 'auto'"),
        (["--issue-shares", "A=0.5,Z=0.5"], "--issue-shares names ['Z'], not in the trace"),
        (["--quotas-file", "bad_field.json"], "quota 'A': give an object with fields"),
        (["--quotas-file", "bad_count.json"], "quota 'A': min_count=2.5 has the wrong type"),
        (["--quotas-file", "bad_completion.json"], "completion_quota='most'"),
    ],
)
def test_conflicting_or_impossible_flags_are_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    """Flags that contradict each other, unknown sources, malformed quotas files, or a trace too
    short for the run exit 2 saying why."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(f'{{"source": "A", "sample_id": "s{k}", "duration_s": 3}}\n' for k in range(50))
    )
    files = {
        "q.json": {"quotas": {}},
        "bad_field.json": {"quotas": {"A": {"min_ratio": 0.5, "schedule": "linear"}}},
        "bad_count.json": {"quotas": {"A": {"min_count": 2.5}}},
        "bad_completion.json": {"quotas": {}, "completion_quota": "most"},
    }
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    extra = [str(tmp_path / e) if e in files else e for e in extra]
    assert main(["replay", "--trace", str(path), "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err
