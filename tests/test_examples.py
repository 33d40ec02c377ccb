"""Every script in examples/ runs as its docstring's ``Run:`` line says and prints what it promises."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from example_checks import EXAMPLES, EXPECTED, ROOT, check_output, command, with_tensorboard

RUN_ELSEWHERE = {"grpo_megatron.py": "test_grpo_example.py"}
"""Examples a longer test already runs with their ``Run:`` command (and more flags) and checks
with ``check_output``: one torchrun launch less."""


RUN = [p for p in EXAMPLES if p.name not in RUN_ELSEWHERE]
PARALLEL = 2
"""Examples run at once, on the 2 cores the suite is sized for: one run's waits (process starts,
imports, rendezvous) overlap the other's work."""


def _run(path: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        with_tensorboard(path, command(path), tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[Future[subprocess.CompletedProcess[str]], Path]]]:
    """The selected examples' runs, ``PARALLEL`` at a time from the module's first test on,
    each with its own folder; each test waits for its own."""
    selected = {
        item.callspec.params["path"]
        for item in request.session.items
        if getattr(item, "originalname", None) == test_example_runs.__name__
    }
    with ThreadPoolExecutor(PARALLEL, thread_name_prefix="example") as pool:
        made = {}
        for path in (p for p in RUN if p in selected):
            folder = tmp_path_factory.mktemp(path.stem)
            made[path.name] = (pool.submit(_run, path, folder), folder)
        yield made
        for future, _ in made.values():
            future.cancel()


@pytest.mark.parametrize("path", RUN, ids=[p.name for p in RUN])
def test_example_runs(
    path: Path, runs: dict[str, tuple[Future[subprocess.CompletedProcess[str]], Path]]
) -> None:
    """The example exits 0 and prints what ``example_checks.check_output`` expects."""
    future, folder = runs[path.name]
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
