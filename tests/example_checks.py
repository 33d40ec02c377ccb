"""What every example must print when run as its docstring's ``Run:`` line says; shared by the tests that run one."""

from __future__ import annotations

import ast
import re
import shlex
import sys
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from knitkit.testing import run_to_end

ROOT = Path(__file__).resolve().parents[1]
SHARED = {"megatron_common.py"}
"""Modules the examples import; not examples themselves."""
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name not in SHARED)

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
    # 4 prompts with 1, 2, 1, 2 images: 6 unique images per mini-batch, encoded once each
    # (a replicated vision path) or once by each of the 2 TP peers (a TP-sharded one).
    "megatron_wrap.py": tuple(
        rf"step {i}: loss [\d.]+, unique images encoded 6$" for i in (1, 2, 3)
    ),
    # 2 prompts (one image each) per mini-batch: each image encoded once per pass (run for
    # 2 steps: conftest.py's grpo_reference_run).
    "grpo_megatron.py": tuple(
        rf"step {i}: loss [-+][\d.e-]+, kl [\d.]+, nll [\d.]+, reward [\d.]+, clipped [\d.]+, "
        r"images encoded 2$"
        for i in (1, 2)
    ),
    "megatron_llava.py": tuple(rf"step {i}: loss [\d.]+, image encodings 12 " for i in (1, 2, 3)),
    "megatron_mrope.py": tuple(rf"step {i}: loss [\d.]+, image encodings 12 " for i in (1, 2, 3)),
}
"""Lines each example must print (regexes); an example not listed must at least print something."""

FORBIDDEN: dict[str, str] = {"admission_in_rollout_loop.py": r"knittrans .* VIOLATED"}
LOSS_FALLS = {"megatron_wrap.py", "megatron_llava.py", "megatron_mrope.py"}
"""Examples whose printed per-step loss must fall from step to step (they train)."""
TENSORBOARD = {
    "megatron_wrap.py": ("knitkit/example/loss", "knitkit/dedup/units_encoded"),
    "grpo_megatron.py": ("knitkit/grpo/loss", "knitkit/grpo/kl", "knitkit/admission/admitted"),
}
"""Examples run with ``--tensorboard DIR``: figures that must be in DIR's event file, per step."""


RUN_LINE = re.compile(r"^Run(?: \((?P<needs>[^)]*)\))?: (?P<command>.+)$", re.MULTILINE)
LAUNCHERS = {
    "python": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def command(path: Path) -> list[str]:
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


def with_tensorboard(path: Path, command: list[str], directory: Path) -> list[str]:
    """``command`` logging to ``directory`` when the example promises TensorBoard figures."""
    return [*command, "--tensorboard", str(directory)] if path.name in TENSORBOARD else command


WARNING_LINE = re.compile(r"^.*:\d+: \w*Warning: .*$", re.MULTILINE)
"""A line ``warnings`` prints (``file:line: Category: message``)."""


def check_output(path: Path, stdout: str, stderr: str, tensorboard: Path) -> None:
    """The example's expected lines and no warning around them; one that trains, a falling loss,
    and one that logs, its figures in ``tensorboard`` at every printed step."""
    assert stdout.strip(), f"{path.name} printed nothing"
    warned = WARNING_LINE.findall(stderr)
    assert not warned, f"{path.name} printed {len(warned)} warnings:\n" + "\n".join(warned[:10])
    for pattern in EXPECTED.get(path.name, ()):
        assert re.search(pattern, stdout, re.MULTILINE), (
            f"{path.name}: no line matches {pattern!r} in:\n{stdout}"
        )
    if path.name in FORBIDDEN:
        assert not re.search(FORBIDDEN[path.name], stdout), stdout
    if path.name in LOSS_FALLS:
        losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)", stdout, re.M)]
        assert len(losses) >= 2 and all(b < a for a, b in pairwise(losses)), stdout
    if path.name in TENSORBOARD:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tensorboard))
        events.Reload()
        steps = [int(s) for s in re.findall(r"^step (\d+):", stdout, re.M)]
        for name in TENSORBOARD[path.name]:
            assert [e.step for e in events.Scalars(name)] == steps, name


GRPO_STEPS = 2
"""Steps of the GRPO example's uninterrupted run (``grpo_reference_run``)."""


@dataclass(frozen=True, slots=True)
class GrpoRun:
    """The GRPO example's uninterrupted run: its output, and what it left in ``workdir``:
    ``grpo.json`` (``--reference``'s comparison), ``tb`` (TensorBoard), ``ckpt``, ``ledger``
    (the exactly-once ledger) and ``final`` (every rank's final parameters)."""

    workdir: Path
    returncode: int
    stdout: str
    stderr: str


def run_grpo_reference(workdir: Path) -> GrpoRun:
    """The GRPO example as its docstring's ``Run:`` line says, ``GRPO_STEPS`` steps, with
    ``--reference`` and checkpoints, ledger and final parameters under ``workdir`` (the final
    parameters are saved before the plain loop runs, so they are knitkit's)."""
    example = ROOT / "examples" / "grpo_megatron.py"
    run = [
        *command(example),
        *("--steps", str(GRPO_STEPS), "--reference", "--json", str(workdir / "grpo.json")),
        *("--checkpoint-dir", str(workdir / "ckpt"), "--ledger", str(workdir / "ledger")),
        *("--final-params", str(workdir / "final")),
    ]
    done = run_to_end(  # torchrun: past its timeout it ends its ranks too
        with_tensorboard(example, run, workdir / "tb"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout_s=600,
    )
    return GrpoRun(workdir, done.returncode, done.stdout, done.stderr)
