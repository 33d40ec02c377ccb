"""Every script in examples/ runs as its docstring's ``Run:`` line says and prints what it promises."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from example_checks import EXAMPLES, EXPECTED, ROOT, check_output, command, with_tensorboard

RUN_ELSEWHERE = {"grpo_megatron.py": "test_grpo_example.py"}
"""Examples a longer test already runs with their ``Run:`` command (and more flags) and checks
with ``check_output``: one torchrun launch less."""


@pytest.mark.parametrize(
    "path",
    [p for p in EXAMPLES if p.name not in RUN_ELSEWHERE],
    ids=[p.name for p in EXAMPLES if p.name not in RUN_ELSEWHERE],
)
def test_example_runs(path: Path, tmp_path: Path) -> None:
    """The example exits 0 and prints what ``example_checks.check_output`` expects."""
    done = subprocess.run(
        with_tensorboard(path, command(path), tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{path.name} failed:\n{done.stdout}\n{done.stderr[-3000:]}"
    check_output(path, done.stdout, done.stderr, tmp_path)


def test_every_example_is_checked() -> None:
    """Examples promise specific output; a new example gets its checks here, and one run by
    another test is checked there."""
    unchecked = {p.name for p in EXAMPLES} - set(EXPECTED)
    assert not unchecked, f"add expected output for {sorted(unchecked)} to EXPECTED"
    for example, test in RUN_ELSEWHERE.items():
        text = (ROOT / "tests" / test).read_text()
        assert example in text and "check_output(" in text, (example, test)
