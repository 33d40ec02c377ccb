"""knitkit.metrics: observers receive one step's flat, namespaced figures and write them where trainers look."""

from __future__ import annotations

import ast
import json
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from knitkit.metrics import (
    FanOut,
    JsonlObserver,
    ProgressLine,
    TensorBoardObserver,
    checked,
    merge,
    read_jsonl,
    sum_over,
)

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("admission", "storage", "microbatch_iter", "encoder_dedup")


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in ``log_dir``, read with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_observer_writes_one_scalar_per_name_and_step(tmp_path: Path) -> None:
    """Each name becomes a TensorBoard tag with one point per step (values float32-exact)."""
    pytest.importorskip("tensorboard", reason="the TensorBoard observer needs knitkit[tensorboard]")
    log_dir = tmp_path / "tb"
    with TensorBoardObserver(log_dir) as observe:
        for step in range(3):
            observe(step, {"knitkit/storage/units_live": 10 - step, "knitkit/demo/loss": 0.5**step})
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700
    series = _scalars(log_dir)
    assert series["knitkit/storage/units_live"] == [(0, 10.0), (1, 9.0), (2, 8.0)]
    assert series["knitkit/demo/loss"] == [(0, 1.0), (1, 0.5), (2, 0.25)]


def test_tensorboard_observer_leaves_the_trainers_writer_open(tmp_path: Path) -> None:
    """Given the trainer's ``SummaryWriter``, knitkit's figures join its run and ``close`` only flushes."""
    pytest.importorskip("tensorboard", reason="the TensorBoard observer needs knitkit[tensorboard]")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    with TensorBoardObserver(writer=writer) as observe:
        observe(0, {"knitkit/admission/pending": 4})
    writer.add_scalar("train/loss", 2.0, 0)  # still usable by its owner
    writer.close()
    assert set(_scalars(tmp_path)) == {"knitkit/admission/pending", "train/loss"}
    with pytest.raises(ValueError, match="exactly one"):
        TensorBoardObserver()
    with pytest.raises(ValueError, match="exactly one"):
        TensorBoardObserver(tmp_path, writer=writer)


def test_missing_tensorboard_is_a_clear_error_naming_the_extra(tmp_path: Path) -> None:
    """Without tensorboard, ``import knitkit.metrics`` works and building the observer says what to install."""
    code = (
        "import sys\n"
        "sys.modules['tensorboard'] = None\n"  # as if it were not installed
        "import knitkit.metrics as m\n"
        "m.JsonlObserver(sys.argv[1])(0, {'knitkit/demo/loss': 1.0})\n"
        "try:\n"
        "    m.TensorBoardObserver(sys.argv[1] + '.tb')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "pip install 'knitkit[tensorboard]'" in done.stdout, done.stdout + done.stderr
    assert not (tmp_path / "m.jsonl.tb").exists()


def test_jsonl_observer_writes_a_flushed_owner_only_line_per_step(tmp_path: Path) -> None:
    """One JSON object per step, readable while the run goes on; ``append`` keeps earlier steps."""
    path = tmp_path / "metrics.jsonl"
    observe = JsonlObserver(path)
    observe(0, {"knitkit/storage/bytes_used": 1024})
    assert [r["knitkit/storage/bytes_used"] for r in read_jsonl(path)] == [1024.0]  # flushed
    observe.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with JsonlObserver(path, append=True) as observe:
        observe(1, {"knitkit/storage/bytes_used": 0})
    rows = read_jsonl(path)
    assert [r["step"] for r in rows] == [0, 1] and all(r["time"] > 0 for r in rows)
    with JsonlObserver(path) as observe:  # a fresh run starts the file afresh
        observe(0, {"knitkit/storage/bytes_used": 7})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0]


@pytest.mark.parametrize(
    ("metrics", "error", "match"),
    [
        ({"loss": 1.0}, ValueError, "'loss'.*knitkit/<part>/<figure>"),
        ({"knitkit/": 1.0}, ValueError, "knitkit/<part>/<figure>"),
        ({"knitkit/storage/ok": "3"}, TypeError, "'knitkit/storage/ok' = '3'.*float"),
        ({"knitkit/storage/flag": True}, TypeError, "plain numbers"),
    ],
)
def test_figures_are_namespaced_plain_numbers(
    metrics: Mapping[str, object], error: type[Exception], match: str
) -> None:
    """A figure outside ``knitkit/<part>/...`` or not a number is refused with its name and value."""
    with pytest.raises(error, match=match):
        checked(metrics)  # type: ignore[arg-type]


def test_merge_refuses_a_name_from_two_sources_and_sum_over_adds_ranks() -> None:
    """Merging snapshots never silently drops a figure; summing over ranks adds name by name."""
    import numpy as np

    merged = merge({"knitkit/admission/pending": 3}, {"knitkit/storage/units_live": np.int64(5)})
    assert merged == {"knitkit/admission/pending": 3.0, "knitkit/storage/units_live": 5.0}
    assert all(type(v) is float for v in merged.values())
    with pytest.raises(ValueError, match="'knitkit/admission/pending' comes from two sources"):
        merge({"knitkit/admission/pending": 3}, {"knitkit/admission/pending": 4})
    ranks = [{"knitkit/dedup/units_encoded": 2, "knitkit/delivery/wait_s": 0.5}] * 3
    ranks.append({"knitkit/dedup/units_encoded": 1})
    assert sum_over(ranks) == {"knitkit/dedup/units_encoded": 7.0, "knitkit/delivery/wait_s": 1.5}


def test_fan_out_checks_once_then_feeds_every_observer_in_order() -> None:
    """A bad figure reaches no observer; a good step reaches each, in order, as plain floats."""
    seen: list[tuple[str, int, dict[str, float]]] = []
    observe = FanOut(
        lambda step, m: seen.append(("a", step, dict(m))),
        lambda step, m: seen.append(("b", step, dict(m))),
    )
    with pytest.raises(ValueError):
        observe(0, {"loss": 1.0})
    assert seen == []
    observe(7, {"knitkit/demo/loss": 1})
    assert seen == [("a", 7, {"knitkit/demo/loss": 1.0}), ("b", 7, {"knitkit/demo/loss": 1.0})]


def test_progress_line_counts_steps_and_estimates_the_time_left() -> None:
    """Progress says how far the run is and how long it took; the time left comes from the steps
    after the first (which also pays for start-up)."""
    lines: list[str] = []
    now = iter([100.0, 130.0, 140.0, 150.0])
    progress = ProgressLine(
        3,
        {"loss": "knitkit/demo/loss", "gone": "knitkit/x/absent"},
        say=lines.append,
        clock=lambda: next(now),
    )
    for step, loss in enumerate((4.25, 3.5, 3.0)):
        progress(step, {"knitkit/demo/loss": loss})
    assert lines == [
        "step 1/3 (33%) 30 s: loss 4.25",
        "step 2/3 (67%) 40 s, ~10 s left: loss 3.5",
        "step 3/3 (100%) 50 s: loss 3",
    ]
    with pytest.raises(ValueError, match="total=0"):
        ProgressLine(0)


def _imports(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def test_metrics_is_glue_no_part_imports_it_and_it_imports_no_part() -> None:
    """Parts expose ``metrics()`` and never import the observers; the observers import no part."""
    own = {m for p in (ROOT / "knitkit/metrics").glob("*.py") for m in _imports(p)}
    parts = {f"knitkit.{part}" for part in PARTS}
    assert not {m for m in own if ".".join(m.split(".")[:2]) in parts}, own
    for part in PARTS:
        for path in (ROOT / "knitkit" / part).rglob("*.py"):
            assert not any(m.startswith("knitkit.metrics") for m in _imports(path)), path
