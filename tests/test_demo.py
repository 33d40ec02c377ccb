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


def test_demo_metrics_flag_is_checked_before_any_work(tmp_path: Path) -> None:
    """``--metrics`` names known sinks; without tensorboard installed the demo says what to do
    before it replays or starts any process."""
    bad = _demo("--out", str(tmp_path), "--metrics", "tensorboard,wandb", timeout=120)
    assert bad.returncode == 2 and "name sinks from tensorboard, jsonl" in bad.stderr, bad.stderr
    code = (
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
