"""The GRPO example SIGKILLed at several points and resumed trains exactly what the uninterrupted run trains."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from example_checks import GRPO_STEPS, GrpoRun  # noqa: E402
from grpo.kill import launch, ledger_violations, max_param_diff  # noqa: E402
from grpo.resume import read_ledgers  # noqa: E402

from knitkit.job.checkpoint import CheckpointDir  # noqa: E402

STEPS = GRPO_STEPS
PARAM_ATOL = 1e-6
"""Resumed vs uninterrupted final parameters, any element: the same plans and the same fp32
sums in the same order give identical values (0 on CPU); the bound leaves room for nothing
else (a step trained twice or lost moves parameters by ~1e-3, the learning rate)."""


@pytest.mark.timeout(900)  # four torchrun launches of about 16 s each on an idle 2-core machine
def test_killed_and_resumed_run_trains_exactly_once(
    tmp_path: Path, grpo_reference_run: GrpoRun
) -> None:
    """Over one job SIGKILLed three times and resumed from its newest checkpoint each time
    (after the second step's reference pass; during the second step's checkpoint save, between
    its files and its rename; while the resumed driver's trajectories are re-written from the
    rollout), every (mini-batch, pass, trajectory) of the uninterrupted run is in the
    exactly-once ledger exactly once and nothing else is, and the final parameters on every
    rank equal the uninterrupted run's within ``PARAM_ATOL``. The uninterrupted run is the
    suite's one launch of the example (``grpo_reference_run``, also compared with the plain
    loop by tests/test_grpo_example.py)."""
    reference = grpo_reference_run.workdir
    assert grpo_reference_run.returncode == 0, grpo_reference_run.stderr[-4000:]
    ref_records = read_ledgers(reference / "ledger")
    per_pass = Counter(r["pass"] for r in ref_records for _ in r["trajectories"])
    assert per_pass == {"old": 16 * STEPS, "ref": 16 * STEPS, "train": 16 * STEPS}, per_pass

    run = tmp_path / "run"
    ckpt = CheckpointDir(run / "ckpt")
    # 1: after step 2's ref pass (passes: old, ref, train per step): checkpoint 1 is newest.
    first = launch(run, STEPS, "pass:5", resume=False)
    assert first.killed and first.returncode != 0, first.summary()
    assert ckpt.latest() == ckpt.path(1)
    # 2: resumed from step 1, killed while saving step 2 (files staged, not renamed).
    second = launch(run, STEPS, "save:1")
    assert second.killed and second.returncode != 0, second.summary()
    assert ckpt.latest() == ckpt.path(1) and ckpt.staging(2).exists()
    # 3: resumed from step 1 again, killed while re-writing the driver's trajectories.
    third = launch(run, STEPS, "rollout:1")
    assert third.killed and third.returncode != 0, third.summary()
    assert "step 2:" not in third.log
    # 4: resumed, runs to the end.
    last = launch(run, STEPS)
    assert last.returncode == 0 and not last.killed, last.summary()
    assert "step 2:" in last.log and "step 1:" not in last.log

    assert ledger_violations(run / "ledger", reference / "ledger") == []
    diff = max_param_diff(run / "final", reference / "final")
    assert diff <= PARAM_ATOL, diff
