"""Atomic checkpoint directories: staged, fsynced, renamed into place; the newest complete one loads."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"
"""The marker a committed checkpoint holds last (its contents: the names of its files)."""
_NAME = re.compile(r"^step-(\d{9})$")
_STAGING = ".staging-"

# NOTE [ Atomic checkpoint directories ]:
# A save writes every file into ``<root>/.staging-step-N`` (a name ``latest`` never picks),
# fsyncs each file, writes the ``COMPLETE`` marker listing them, fsyncs the directory, then
# renames it to ``<root>/step-N`` and fsyncs ``<root>``. ``rename`` of a directory is atomic
# on POSIX file systems, so at any crash point ``<root>`` holds the previous ``step-*``
# directories untouched plus, at most, a staging directory (ignored and removed by the next
# save) or a complete new one. ``latest`` picks the highest ``step-N`` whose marker exists and
# lists files that all exist, so even a file system that reorders the rename before the data
# (no fsync honoured) is caught rather than loaded. Older checkpoints are deleted only after
# the new one is in place (``keep``). Directories and files are owner-only (0700 / 0600).
# Several ranks may write files into one staging directory (each its own shard); one process
# (rank 0) commits after a barrier: ``stage`` is idempotent across processes.


@dataclass(frozen=True, slots=True)
class CheckpointDir:
    """A root directory of numbered checkpoints (``step-N``), each saved atomically.

    ``stage(step)`` gives the staging directory to write into (every rank may write its own
    files); ``commit(step)`` makes it the newest checkpoint; ``latest()`` finds the newest
    complete one. See NOTE [ Atomic checkpoint directories ].
    """

    root: Path
    keep: int = 2
    """Complete checkpoints kept after a commit (the newest ``keep``)."""

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"CheckpointDir.keep={self.keep}: keep at least the newest one")

    def path(self, step: int) -> Path:
        return Path(self.root) / f"step-{step:09d}"

    def staging(self, step: int) -> Path:
        return Path(self.root) / f"{_STAGING}{self.path(step).name}"

    def stage(self, step: int, *, fresh: bool = True) -> Path:
        """The staging directory of ``step``, created; ``fresh`` first removes what a crashed
        save left there (the committing rank passes True, then a barrier, then every rank
        writes its files with ``fresh=False``)."""
        if self.path(step).exists():
            raise FileExistsError(f"checkpoint {self.path(step)} exists already; save a new step")
        _mkdir(Path(self.root))
        staging = self.staging(step)
        if fresh:
            shutil.rmtree(staging, ignore_errors=True)
        _mkdir(staging)
        return staging

    def commit(self, step: int) -> Path:
        """Fsync every staged file, mark the checkpoint complete, rename it into place, and drop
        checkpoints older than the newest ``keep`` and stale staging directories."""
        staging, final = self.staging(step), self.path(step)
        names = sorted(p.name for p in staging.iterdir() if p.name != COMPLETE)
        if not names:
            raise ValueError(f"{staging} holds no files; write the checkpoint's files first")
        for name in names:
            _fsync_file(staging / name)
        write_file(staging / COMPLETE, json.dumps({"files": names}).encode())
        _fsync_dir(staging)
        os.rename(staging, final)
        _fsync_dir(Path(self.root))
        self._prune(step)
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint directory, or ``None`` when there is none."""
        root = Path(self.root)
        if not root.is_dir():
            return None
        steps = sorted(
            (int(m[1]) for p in root.iterdir() if (m := _NAME.match(p.name))), reverse=True
        )
        for step in steps:
            if complete(self.path(step)):
                return self.path(step)
        return None

    def _prune(self, newest: int) -> None:
        root = Path(self.root)
        for p in root.iterdir():
            if p.name.startswith(_STAGING):
                shutil.rmtree(p, ignore_errors=True)
        kept = 0
        for step in sorted(
            (int(m[1]) for p in root.iterdir() if (m := _NAME.match(p.name))), reverse=True
        ):
            if step > newest:
                continue
            if kept < self.keep and complete(self.path(step)):
                kept += 1
            else:
                shutil.rmtree(self.path(step), ignore_errors=True)


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint directory ``step-N``."""
    match = _NAME.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (step-<9 digits>)")
    return int(match[1])


def complete(path: Path) -> bool:
    """Whether ``path`` is a committed checkpoint: its marker exists and names files that exist."""
    try:
        names = json.loads((Path(path) / COMPLETE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((Path(path) / name).is_file() for name in names)


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` owner-only and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, state: Any) -> None:
    """``state`` (plain data) as JSON, owner-only and fsynced."""
    write_file(path, json.dumps(state, separators=(",", ":")).encode())


def read_json(path: Path) -> Any:
    """JSON written by ``write_json`` (plain data only: nothing is unpickled)."""
    return json.loads(Path(path).read_text())


def _mkdir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
