"""The main job: `knitkit demo` runs the whole path with real processes and reports honest figures."""

import json
import math
import subprocess
import sys
from pathlib import Path


def test_demo_runs_end_to_end_and_reports(tmp_path: Path) -> None:
    """One train batch through admission, store, reorganizers, prefetch and dedup training.

    Invariants: knitkit reads exactly the bytes trainers consume; every unit is freed; every
    complete train batch meets its quotas; each unique image is encoded once per mini-batch.
    """
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "knitkit",
            "demo",
            "--out",
            str(out),
            "--train-batches",
            "1",
            "--replay-train-batches",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
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
    # 64 trajectories = 8 GRPO groups of 8, one image each: 8 encodings with dedup.
    assert figures["encoder.dedup_units"] == 8
    assert figures["encoder.dup_units"] == 8 * 8 * 2  # every trajectory on both CP ranks
    assert len(figures["loss"]) == 4 and all(math.isfinite(x) for x in figures["loss"])
    assert figures["replay.knittrans.violations"] == 0
    assert (out / "demo.png").stat().st_size > 0 and (out / "replay.png").stat().st_size > 0
