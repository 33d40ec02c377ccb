"""Kill-and-resume runs of the GRPO example: launch it (SIGKILLed at a named point), resume, and check the result."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.resume import KILL_ENV, read_ledgers
from knitkit.cli import main
from knitkit.testing import run_to_end

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Launch:
    """One torchrun launch of the example: its exit status, whether rank 0 was SIGKILLed, its log."""

    returncode: int
    killed: bool
    log: str

    def summary(self) -> str:
        """What a failed launch says: the first rank's traceback and the launcher's last lines."""
        lines = self.log.splitlines()
        first = next((i for i, line in enumerate(lines) if "Traceback" in line), len(lines))
        return "\n".join([*lines[first : first + 80], "...", *lines[-30:]])


def launch(
    workdir: Path, steps: int, kill: str = "", *, resume: bool = True, timeout_s: float = 600
) -> Launch:
    """Run the example (DP2 x TP2, gloo) with checkpoints, ledger and final parameters under
    ``workdir``; ``kill`` (``<point>:<count>``) SIGKILLs rank 0's process group there."""
    env = {k: v for k, v in os.environ.items() if k != KILL_ENV}
    if kill:
        env[KILL_ENV] = kill
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"),
        *("examples/grpo_megatron.py", "--steps", str(steps)),
        *("--checkpoint-dir", str(workdir / "ckpt"), "--ledger", str(workdir / "ledger")),
        *("--final-params", str(workdir / "final")),
        *(("--resume",) if resume else ()),
    ]
    # a timeout ends torchrun with SIGTERM, so it ends its ranks (NOTE [ Ending a launcher ])
    done = run_to_end(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout_s=timeout_s
    )
    log = done.stdout + done.stderr
    killed = "exitcode  : -9" in log
    if killed:  # SIGKILL leaves the job's shared memory behind: what an operator runs after a crash
        shm_clean()
    return Launch(done.returncode, killed, log)


def shm_clean() -> None:
    """``knitkit shm-clean`` run in this process, through the command's own entry
    (``knitkit.cli.main``): an interpreter start less per killed launch (0.4-0.8 s each on a
    2-core machine). Its report is kept off stdout, as the command's process kept it before."""
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        status = main(["shm-clean"])
    if status != 0:
        raise RuntimeError(f"knitkit shm-clean exited {status}: {report.getvalue()}")


def max_param_diff(a: Path, b: Path) -> float:
    """Largest |difference| of any parameter element between two runs' final parameters (every rank)."""
    worst = 0.0
    for path in sorted(a.glob("rank*.pt")):
        mine = torch.load(path, weights_only=True)
        theirs = torch.load(b / path.name, weights_only=True)
        if mine.keys() != theirs.keys():
            raise ValueError(f"{path.name}: the runs hold different parameters")
        for name, value in mine.items():
            if torch.is_tensor(value) and value.is_floating_point():
                diff = (value.double() - theirs[name].double()).abs().max().item()
                worst = max(worst, diff)
    return worst


def ledger_violations(ledger: Path, reference: Path) -> list[str]:
    """What breaks exactly-once: a (mini-batch, pass, trajectory) trained twice, or one the
    uninterrupted run trained that this run did not (lost), or one it never trained (foreign)."""
    mine = _records(ledger)
    theirs = _records(reference)
    twice = [f"twice: {r}" for r, n in mine.items() if n > 1]
    lost = [f"lost: {r}" for r in theirs if r not in mine]
    foreign = [f"not in the uninterrupted run: {r}" for r in mine if r not in theirs]
    return twice + lost + foreign


def _records(directory: Path) -> Counter[tuple[str, str, str]]:
    return Counter(
        (r["mb"], r["pass"], t) for r in read_ledgers(directory) for t in r["trajectories"]
    )
