"""Every script in examples/ runs as its docstring's ``Run:`` line says and prints what it promises."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import pytest
from background import in_background, selected
from example_checks import EXAMPLES, EXPECTED, ROOT, check_output, command, with_tensorboard

from knitkit.testing import run_to_end

RUN_ELSEWHERE = {"grpo_megatron.py": "test_grpo_example.py"}
"""Examples a longer test already runs with their ``Run:`` command (and more flags) and checks
with ``check_output``: one torchrun launch less."""


RUN = [p for p in EXAMPLES if p.name not in RUN_ELSEWHERE]


def _run(path: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return run_to_end(  # a torchrun example past its timeout ends its ranks too
        with_tensorboard(path, command(path), tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout_s=300,
    )


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[Path, tuple[Future[subprocess.CompletedProcess[str]], Path]]]:
    """The selected examples' runs, in the background from the module's first test on
    (``in_background``), each with its own folder; each test waits for its own."""
    folders = {
        p: tmp_path_factory.mktemp(p.stem) for p in selected(request, test_example_runs, "path")
    }
    calls = {p: partial(_run, p, folder) for p, folder in folders.items()}
    with in_background(calls) as futures:
        yield {p: (futures[p], folders[p]) for p in folders}


@pytest.mark.parametrize("path", RUN, ids=[p.name for p in RUN])
def test_example_runs(
    path: Path, runs: dict[Path, tuple[Future[subprocess.CompletedProcess[str]], Path]]
) -> None:
    """The example exits 0 and prints what ``example_checks.check_output`` expects."""
    future, folder = runs[path]
    done = future.result()
    assert done.returncode == 0, f"{path.name} failed:\n{done.stdout}\n{done.stderr[-3000:]}"
    check_output(path, done.stdout, done.stderr, folder)


def test_every_example_is_checked() -> None:
    """Examples promise specific output; a new example gets its checks here, and one run by
    another test is checked there."""
    unchecked = {p.name for p in EXAMPLES} - set(EXPECTED)
    assert not unchecked, f"add expected output for {sorted(unchecked)} to EXPECTED"
    for example, test in RUN_ELSEWHERE.items():
        text = (ROOT / "tests" / test).read_text()
        assert example in text and "check_output(" in text, (example, test)
