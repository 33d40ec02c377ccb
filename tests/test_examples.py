"""Every script in examples/ runs as its docstring's ``Run:`` line says and prints what it promises."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

EXPECTED: dict[str, tuple[str, ...]] = {
    "admission_in_rollout_loop.py": (
        r"streaming train batch \d+ .* quotas VIOLATED",
        r"knittrans train batch 0 .* quotas met",
        r"knittrans train batch 1 .* quotas met",
    ),
    "store_with_disk_backend.py": (
        r"stored 4 trajectories, 1 image unit\(s\)",
        r"CP slice: 256 tokens, read 1024 of 2048 bytes",
        r"updated prompt0-0/advantages: \(512,\) float32",
    ),
    # Whether prefetch hides the waits is measured in benchmarks/prefetch.py, not asserted here.
    "prefetch_around_dataloader.py": (r"eager +: [\d.]+ s waiting", r"prefetch : [\d.]+ s waiting"),
    "dedup_plain_pytorch.py": (
        r"encoder ran on 8 images \(plain\) vs 2 \(dedup\)",
        r"max gradient difference: .* \(equal\)",
    ),
}
"""Lines each example must print (regexes); an example not listed must at least print something."""

FORBIDDEN: dict[str, str] = {"admission_in_rollout_loop.py": r"knittrans .* VIOLATED"}


RUN_LINE = re.compile(r"^Run(?: \((?P<needs>[^)]*)\))?: (?P<command>.+)$", re.MULTILINE)
LAUNCHERS = {
    "python": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def _command(path: Path) -> list[str]:
    """The example's ``Run:`` command with this interpreter; skips when it needs GPUs we lack."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    match = RUN_LINE.search(doc)
    assert match, f"{path.name}: its docstring needs a 'Run: python examples/{path.name}' line"
    words = shlex.split(match["command"])
    needs = match["needs"] or ""
    if "GPU" in needs:
        nproc = (
            int(words[words.index("--nproc-per-node") + 1]) if "--nproc-per-node" in words else 1
        )
        if torch.cuda.device_count() < nproc:
            pytest.skip(f"{path.name} needs {needs} ({nproc} GPUs): {match['command']}")
    assert words[0] in LAUNCHERS, f"{path.name}: unknown launcher {words[0]!r}"
    return [*LAUNCHERS[words[0]], *words[1:]]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    """The example exits 0 within two minutes and prints its expected lines."""
    done = subprocess.run(_command(path), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{path.name} failed:\n{done.stdout}\n{done.stderr[-3000:]}"
    patterns = EXPECTED.get(path.name, ())
    assert done.stdout.strip(), f"{path.name} printed nothing"
    for pattern in patterns:
        assert re.search(pattern, done.stdout), (
            f"{path.name}: no line matches {pattern!r} in:\n{done.stdout}"
        )
    if path.name in FORBIDDEN:
        assert not re.search(FORBIDDEN[path.name], done.stdout), done.stdout


def test_every_example_is_checked() -> None:
    """Examples promise specific output; a new example (other than the Megatron ones) gets checks here."""
    megatron = {"megatron_wrap.py", "megatron_llava.py", "megatron_mrope.py"}  # gloo-world tests
    unchecked = {p.name for p in EXAMPLES} - set(EXPECTED) - megatron
    assert not unchecked, f"add expected output for {sorted(unchecked)} to EXPECTED"
