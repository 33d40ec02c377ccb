"""Checkpoint and resume of the GRPO example: model, optimizer, driver and rollout saved at a step boundary, atomically."""

from __future__ import annotations

import io
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from knitkit.job.checkpoint import CheckpointDir, read_json, write_file, write_json

KILL_ENV = "KNITKIT_GRPO_KILL"
"""``<point>:<count>``: rank 0 SIGKILLs its process group the count-th time it reaches the point
(``rollout``: a group written; ``pass``: a pass finished and recorded; ``save``: a checkpoint's
files written, before its commit). For the kill tests (tests/job/test_kill_resume.py)."""
KILL_POINTS = ("rollout", "pass", "save")


@dataclass(slots=True)
class KillPoint:
    """The hidden crash hook (``KNITKIT_GRPO_KILL``); inert unless set, and only on rank 0."""

    point: str = ""
    count: int = 0
    seen: int = 0

    @classmethod
    def from_env(cls) -> KillPoint:
        value = os.environ.get(KILL_ENV, "")
        if not value:
            return cls()
        point, _, count = value.partition(":")
        if point not in KILL_POINTS or not count.isdigit():
            raise ValueError(f"{KILL_ENV}={value!r}: give <point>:<count>, point in {KILL_POINTS}")
        return cls(point, int(count))

    def hit(self, point: str) -> None:
        if point != self.point or dist.get_rank() != 0:
            return
        self.seen += 1
        if self.seen == self.count:
            # The driver's host dies with its reorganizer processes (one process group); torchrun
            # then stops the other ranks: the whole job is gone, as on a preempted node.
            os.killpg(os.getpgid(0), signal.SIGKILL)


class ExactlyOnceLedger:
    """Appended ``{"mb", "pass", "trajectories"}`` records, one line each, fsynced: what this DP
    group consumed (written by its TP rank 0). On resume it is cut back to its length at the
    checkpoint: records past it belong to work the checkpoint does not hold, which the resumed
    run redoes (see NOTE [ Resume rule ] in knitkit/job/checkpoint_state.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)
        os.fsync(self._fd)

    def record(self, minibatch_id: str, pass_name: str, trajectories: list[str]) -> None:
        line = json.dumps({"mb": minibatch_id, "pass": pass_name, "trajectories": trajectories})
        os.write(self._fd, (line + "\n").encode())
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def read_ledgers(directory: Path) -> list[dict[str, Any]]:
    """Every record of every group's ledger in ``directory``."""
    return [
        json.loads(line)
        for path in sorted(directory.glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


@dataclass(slots=True)
class Checkpointing:
    """Where and how often the loop checkpoints, the ledger it keeps, and its crash hook."""

    root: CheckpointDir
    every: int = 1
    """Save after every ``every``-th optimizer step."""
    resume: bool = False
    ledger_dir: Path | None = None
    kill: KillPoint = field(default_factory=KillPoint.from_env)
    ledger: ExactlyOnceLedger | None = None
    _loaded: dict[str, Any] | None = None

    def open(self, group: str, writer: bool) -> int:
        """Pick the checkpoint to resume from (the newest complete one, agreed by every rank),
        open this group's ledger (``writer``: this rank keeps it) cut back to that checkpoint;
        returns its step (0: start afresh)."""
        latest = self.root.latest()
        if latest is not None and not self.resume:
            raise FileExistsError(
                f"{self.root.root} holds checkpoint {latest.name}; pass --resume to continue "
                "from it, or give another --checkpoint-dir"
            )
        step = torch.tensor([0 if latest is None else int(latest.name.split("-")[1])])
        dist.broadcast(step, src=0)  # rank 0's choice, as a number (nothing unpickled)
        done = int(step[0])
        if done:
            path = self.root.path(done) / f"rank{dist.get_rank()}.pt"
            self._loaded = torch.load(path, weights_only=True)  # tensors and plain data only
        if writer and self.ledger_dir is not None:
            self.ledger = ExactlyOnceLedger(self.ledger_dir / f"{group}.jsonl")
            self.ledger.truncate(int(self._loaded["ledger_bytes"]) if self._loaded else 0)
        return done

    def load_trainer(self, trainer: Any) -> None:
        """This rank's model and optimizer state of the checkpoint ``open`` picked (if any)."""
        if self._loaded is None:
            return
        trainer.policy.load_state_dict(self._loaded["model"])
        trainer.optimizer.load_state_dict(self._loaded["optim"])
        self._loaded = None

    def knitkit_state(self, step: int) -> dict[str, Any]:
        """Rank 0's part of checkpoint ``step``: the driver's and the rollout's state."""
        return dict(read_json(self.root.path(step) / "knitkit.json"))

    def save(self, step: int, trainer: Any, knitkit_state: Any) -> None:
        """Every rank: save checkpoint ``step`` (rank 0 adds ``knitkit_state()``, plain data),
        atomically (see NOTE [ Atomic checkpoint directories ] in knitkit/job/checkpoint.py)."""
        rank = dist.get_rank()
        if rank == 0:
            self.root.stage(step, fresh=True)
        dist.barrier()
        staging = self.root.staging(step)
        buffer = io.BytesIO()
        torch.save(
            {
                "model": trainer.policy.state_dict(),
                "optim": trainer.optimizer.state_dict(),
                "ledger_bytes": self.ledger.size if self.ledger is not None else 0,
            },
            buffer,
        )
        write_file(staging / f"rank{rank}.pt", buffer.getvalue())
        if rank == 0:
            write_json(staging / "knitkit.json", {"step": step, **knitkit_state()})
        dist.barrier()
        if rank == 0:
            self.kill.hit("save")
            self.root.commit(step)
        dist.barrier()

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
