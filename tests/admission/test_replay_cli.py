"""`knitkit replay`: table, JSON summary, plot, user traces, clear errors."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from knitkit.admission.replay import (
    ProgressBar,
    ReplaySettings,
    SourceProfile,
    generate_trace,
    preset,
    write_jsonl,
)
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


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rho", "nan"], "--rho=nan: give a finite number > 0"),
        (["--rho", "inf"], "--rho=inf: give a finite number > 0"),
        (["--rho", "0"], "--rho=0.0: give a finite number > 0"),
        (["--oversample", "nan"], "--oversample=nan: give a finite number >= 0"),
        (["--oversample", "-1"], "--oversample=-1.0: give a finite number >= 0"),
        (["--source-cap", "0"], "--source-cap=0.0: give a finite number > 0"),
        (["--source-cap", "-1"], "--source-cap=-1.0: give a finite number > 0"),
        (["--slots", "0"], "--slots=0: must be >= 1"),
        (["--minibatches", "-1"], "--minibatches=-1: must be >= 1"),
        (["--train-batch-size", "0"], "--train-batch-size=0: must be >= 1"),
        (["--max-staleness", "-1"], "--max-staleness=-1: must be >= 0"),
        (["--seed", "-1"], "--seed=-1: must be >= 0"),
        (["--train-batches", "1"], "--train-batches 1: give at least 2"),
        (["--policies", ","], "--policies ',' names no policy"),
        (["--issue-shares", "A=nan,B=1,C=1,D=1"], "--issue-shares A=nan: give a finite number"),
        (["--issue-shares", "A=1,Z=1"], "--issue-shares names ['Z'], not in the trace"),
    ],
)
def test_bad_flag_values_are_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    """NaN, infinite, zero or negative values, an empty policy list and issue shares for an
    unknown source are refused before anything runs, naming the flag (issue 25: some ran and
    printed negative staleness, some failed with "cannot convert float NaN to integer", some
    printed an empty table or stalled)."""
    assert main(["replay", "--train-batches", "8", "--quiet", *extra]) == 2
    err = capsys.readouterr()
    assert message in err.err and err.out == ""


def test_stalls_name_the_cause(capsys: pytest.CaptureFixture[str]) -> None:
    """A replay that cannot go on names the quota that could not be fed and why: with
    --max-staleness 0 everything went stale, and the advice says to raise it."""
    argv = ["replay", "--policies", "knittrans", "--train-batches", "8", "--quiet"]
    assert main([*argv, "--max-staleness", "0"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"quota '[A-D]' ran short by \d+ trajectories", err)
    assert "went stale (max_staleness=0): raise --max-staleness" in err


def readme_quotas_example() -> dict:
    """The ``quotas.json`` example of the admission README, as written there."""
    readme = Path(__file__).parents[2] / "knitkit" / "admission" / "README.md"
    text = readme.read_text(encoding="utf-8")
    block = text[text.index("`quotas.json`") :]
    block = block[
        block.index("```json") + len("```json") : block.index("```", block.index("```json") + 7)
    ]
    return json.loads(block)


def test_the_readme_quotas_file_with_groups_replays_without_violations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's quotas.json (quotas under different group labels, an upper bound, a
    completion quota) replays through the CLI on a trace whose unquota'd source completes
    first, and every guarded policy meets every quota: the guard is joint over the groups."""
    example = readme_quotas_example()
    groups = {q.get("group", "sources") for q in example["quotas"].values()}
    assert len(groups) > 1, "the README example must use more than one group"
    profiles = tuple(
        SourceProfile(name=name, median_s=median, sigma=0.5)
        for name, median in (("chat", 10.0), ("math", 60.0), ("code", 120.0))
    )
    path, quotas = tmp_path / "t.jsonl", tmp_path / "quotas.json"
    write_jsonl(generate_trace(profiles, samples_per_source=2500, group_size=1, seed=0), path)
    quotas.write_text(json.dumps(example))
    out = tmp_path / "r.json"
    argv = ["replay", "--trace", str(path), "--quotas-file", str(quotas), "--quiet"]
    argv += ["--train-batch-size", "160", "--issue-shares", "chat=0.2,math=0.4,code=0.4"]
    argv += ["--train-batches", "10", "--policies", "barrier,linear,knittrans,adaptive"]
    assert main([*argv, "--json", str(out)]) == 0, capsys.readouterr().err
    summary = json.loads(out.read_text())
    assert summary["settings"]["quotas"]["code"] == {"lower": 64, "upper": None}
    for name, entry in summary["policies"].items():
        assert entry["violations"] == 0, name


def test_progress_is_one_line_per_finished_run_off_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Off a terminal, replay progress is one stderr line per finished run (the colocated
    reference, then each policy); stdout holds only the table."""
    assert main(["replay", "--policies", "linear,knittrans", "--train-batches", "6"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("replay: ")]
    assert [line.split()[1] for line in lines] == ["colocated", "linear", "knittrans"]
    assert "18/18 train batches" in lines[-1]
    assert captured.out.splitlines()[0].startswith("policy")
