"""The main job: `knitkit demo` runs the whole path with real processes and reports honest figures."""

import json
import math
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest

from knitkit.metrics import read_jsonl

PER_STEP = (
    "knitkit/admission/admitted",
    "knitkit/admission/pending",
    "knitkit/admission/last_minibatch/size",
    "knitkit/admission/last_minibatch/staleness_mean",
    "knitkit/admission/quota/A/count",
    "knitkit/admission/quota/A/target",
    "knitkit/storage/units_live",
    "knitkit/storage/shm_used_bytes",
    "knitkit/delivery/reorganizer_bytes_read",
    "knitkit/job/write_back_bytes",
    "knitkit/job/passes_consumed",
    "knitkit/delivery/micro_batches",
    "knitkit/delivery/exposed_wait_s",
    "knitkit/delivery/decode_s",
    "knitkit/dedup/units_encoded",
    "knitkit/dedup/encode_s",
    "knitkit/demo/loss",
)
"""Figures the demo logs at every optimizer step (admission, storage, delivery, job, dedup, loss)."""


def _demo(*args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "knitkit", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_demo_runs_end_to_end_and_reports(tmp_path: Path) -> None:
    """One train batch through the driver and rank handles: admission, store, reorganizers,
    prefetch, an old-log-prob pass written back, and dedup training.

    Invariants: knitkit reads exactly the bytes trainers consume over both passes; every unit is
    freed; every complete train batch meets its quotas; each unique image is encoded once per
    mini-batch in each pass; the old log-probs of every token come back through the store.
    """
    out = tmp_path / "out"
    proc = _demo("--out", str(out), "--train-batches", "1", "--replay-train-batches", "8")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Encoder dedup" in proc.stdout and "step 4/4" in proc.stderr
    figures = json.loads((out / "report.json").read_text())
    assert figures["bytes.knitkit_ratio"] == 1.0
    assert figures["bytes.sample_level_ratio"] > 1.5
    assert figures["units_left_in_store"] == 0
    for policy in ("knittrans", "barrier"):
        batches = figures[f"live.{policy}.train_batches"]
        assert batches >= 1
        assert figures[f"live.{policy}.train_batches_meeting_quotas"] == batches
    assert figures["live.knittrans.first_minibatch_fraction"] < 1.0
    assert figures["live.barrier.first_minibatch_fraction"] == 1.0
    # 64 trajectories = 8 GRPO groups of 8, one image each: 8 encodings with dedup (train pass).
    assert figures["encoder.dedup_units"] == 8
    assert figures["encoder.dup_units"] == 8 * 8 * 2  # every trajectory on both CP ranks
    assert len(figures["loss"]) == 4 and all(math.isfinite(x) for x in figures["loss"])
    assert figures["replay.knittrans.violations"] == 0
    assert (out / "demo.png").stat().st_size > 0 and (out / "replay.png").stat().st_size > 0
    _check_metrics(out, figures)


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the event file(s) in ``log_dir``, read with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def _check_metrics(out: Path, figures: dict) -> None:
    """The demo's per-step figures reach TensorBoard and the JSON lines, one point per optimizer
    step, with values that agree with the run: 64 trajectories admitted in 4 mini-batches of whole
    GRPO groups, one unique image per group encoded in each of the two passes, every token's old
    log-prob written back (4 bytes each), both passes consumed per step, each source's quota
    target 16, cumulative counters never falling, the last bytes-read figure equal to the
    report's, the logged loss the report's loss."""
    series = _scalars(out / "tensorboard")
    steps = [1, 2, 3, 4]
    for name in PER_STEP:
        assert [s for s, _ in series.get(name, [])] == steps, (name, sorted(series))
    value = {name: [v for _, v in points] for name, points in series.items()}
    sizes = value["knitkit/admission/last_minibatch/size"]
    assert sum(sizes) == 64 and all(s > 0 and s % 8 == 0 for s in sizes), sizes
    assert value["knitkit/dedup/units_encoded"] == [2 * s / 8 for s in sizes]  # two passes
    assert value["knitkit/job/passes_consumed"] == [2.0 * (i + 1) for i in range(4)]
    assert value["knitkit/admission/admitted"] == [sum(sizes[: i + 1]) for i in range(4)]
    assert value["knitkit/admission/quota/A/target"] == [16.0] * 4  # ceil(0.24 * 64)
    assert all(v >= 0 for v in value["knitkit/admission/last_minibatch/staleness_mean"])
    for counter in (
        "knitkit/delivery/reorganizer_bytes_read",
        "knitkit/job/write_back_bytes",
        "knitkit/job/passes_consumed",
        "knitkit/delivery/micro_batches",
        "knitkit/delivery/exposed_wait_s",
        "knitkit/delivery/decode_s",
    ):
        assert all(b >= a >= 0 for a, b in pairwise(value[counter])), counter
    assert value["knitkit/delivery/reorganizer_bytes_read"][-1] == figures["bytes.knitkit_read"]
    assert value["knitkit/job/write_back_bytes"][-1] == figures["passes.written_back_bytes"] > 0
    assert value["knitkit/storage/units_live"][0] > value["knitkit/storage/units_live"][-1] > 0
    assert all(v > 0 for v in value["knitkit/storage/shm_used_bytes"])
    assert all(v > 0 for v in value["knitkit/dedup/encode_s"])
    assert value["knitkit/demo/loss"] == pytest.approx(figures["loss"], rel=1e-6)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == steps
    assert {n for n in rows[0] if n.startswith("knitkit/")} == {
        n for n in series if n.startswith("knitkit/")
    }


def test_demo_metrics_flag_is_checked_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--metrics`` names known sinks (checked in this process: argparse refuses before any
    work); without tensorboard installed the demo says what to do before it replays or starts
    any process."""
    from knitkit.cli import main

    with pytest.raises(SystemExit) as bad:
        main(["demo", "--out", str(tmp_path), "--metrics", "tensorboard,wandb"])
    stderr = capsys.readouterr().err
    assert bad.value.code == 2 and "name sinks from tensorboard, jsonl" in stderr, stderr
    code = (  # a process of its own: tensorboard may be imported in this one already
        "import sys\n"
        "sys.modules['tensorboard'] = None\n"  # as if it were not installed
        "from knitkit.cli import main\n"
        "sys.exit(main(['demo', '--out', sys.argv[1]]))\n"
    )
    missing = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode != 0
    assert "pip install 'knitkit[tensorboard]'" in missing.stderr, missing.stderr[-2000:]
    assert "or pass --metrics jsonl" in missing.stderr and "trace replay" not in missing.stderr
    assert not (tmp_path / "report.json").exists()


def test_demo_help_documents_every_flag() -> None:
    """``knitkit demo --help`` says what each knob does, ``--metrics`` included."""
    import argparse

    from knitkit.demo import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    assert "metrics" in flags
    assert all(flags.values()), [name for name, text in flags.items() if not text]


def _drawn(ax: object) -> tuple[object, ...]:
    """What an axes plots: every line's and every scatter's data, rounded."""
    import numpy as np

    lines = [tuple(np.round(np.asarray(line.get_ydata(), float), 9)) for line in ax.get_lines()]  # type: ignore[attr-defined]
    points = [tuple(np.round(c.get_offsets(), 9).ravel()) for c in ax.collections]  # type: ignore[attr-defined]
    return tuple(sorted(map(str, lines + points)))


def test_replay_figure_panels_show_what_differs_per_policy() -> None:
    """The replay figure of a real replay (paper4, 4 policies): no two panels plot the same data
    (the old one drew the train-batch composition once per policy: four identical panels), the
    staleness per step and the admission times are drawn for every policy, and the composition,
    the same under every policy here, once, saying so."""
    import matplotlib.pyplot as plt

    from knitkit.admission.replay import preset, run_replay
    from knitkit.admission.replay.plot import replay_figure

    paper4 = preset("paper4")
    settings = paper4.settings.with_(train_batches=8, warmup=4, seed=0)
    policies = ("barrier", "linear", "knittrans", "adaptive")
    summary = run_replay(paper4.trace(settings), settings, policies)
    fig = replay_figure(summary)
    try:
        drawn = [_drawn(ax) for ax in fig.axes if ax.get_lines() or ax.collections]
        assert len(set(drawn)) == len(drawn), "two panels plot the same data"
        titles = {ax.get_title(): ax for ax in fig.axes}
        staleness = titles["Architectural staleness per train batch"]
        assert [t.get_text() for t in staleness.get_legend().get_texts()] == list(policies)
        (composition,) = (ax for t, ax in titles.items() if t.startswith("Train-batch composition"))
        assert "the same under all 4 policies" in composition.get_title()
        assert len(composition.get_lines()) == len(summary["settings"]["sources"]) + 1  # + quota
    finally:
        plt.close(fig)


def test_demo_figure_compares_admissions_over_the_same_mini_batches() -> None:
    """demo.png's admissions panel covers the mini-batches both policies admitted (the barrier
    shadow admits more of the stream than the driver trains on), so the earlier policy is the one
    to the left, not the one with fewer; the encoder panels say what each measures, encodings
    (count, 384 -> 24: 16x) and fwd+bwd time, each with its own ratio."""
    import matplotlib.pyplot as plt

    from knitkit.demo.pipeline import AdmissionRecord, PipelineResult
    from knitkit.demo.report import report_figure

    live = PipelineResult(num_minibatches=4)
    early, late = AdmissionRecord(), AdmissionRecord()
    for i in range(12):
        early.add(i // 4, {"A": 8}, 100.0 * i)
    for i in range(24):
        late.add(i // 4, {"A": 8}, 600.0 * (i // 4 + 1))
    live.admission = {"knittrans": early, "barrier": late}
    figures = {
        "loss": [3.0, 2.5, 2.0],
        "bytes.consumed": 1 << 20,
        "bytes.knitkit_read": 1 << 20,
        "bytes.sample_level_read": 3 << 20,
        "encoder.dup_units": 384,
        "encoder.dedup_units": 24,
        "encoder.dup_s": 4.0,
        "encoder.dedup_s": 1.0,
    }
    fig = report_figure(figures, live)
    try:
        (admissions,) = (ax for ax in fig.axes if "admitted" in ax.get_title())
        knittrans, barrier = admissions.get_lines()
        assert max(knittrans.get_ydata()) == max(barrier.get_ydata()) == 12
        assert all(a <= b for a, b in zip(knittrans.get_xdata(), barrier.get_xdata(), strict=True))
        titles = [ax.get_title() for ax in fig.axes]
        assert any("runs" in t and "16.0x" in t for t in titles), titles
        assert any("time" in t and "4.0x" in t for t in titles), titles
    finally:
        plt.close(fig)
