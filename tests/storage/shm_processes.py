"""Helpers shared by the /dev/shm tests: a Python child of this checkout, a second pid namespace."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_PROBE_S = 120


def python(code: str, *prefix: str, stdin: int | None = None) -> subprocess.Popen[str]:
    """``code`` (dedented) in a fresh interpreter of this checkout, after the command ``prefix``;
    text pipes for stdout and stderr, and for stdin unless ``stdin`` is given."""
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE if stdin is None else stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=str(ROOT),
    )


def unshare_pid() -> list[str]:
    """The command prefix that runs a process in a new pid namespace with its own /proc (skips
    the test where this machine cannot make one)."""
    prefix = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        done = subprocess.run([*prefix, "true"], capture_output=True, timeout=_PROBE_S)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"no `unshare` to make a second pid namespace here: {exc}")
    if done.returncode != 0:
        pytest.skip(
            "cannot create a pid namespace here (needs root or CAP_SYS_ADMIN): "
            + done.stderr.decode().strip()
        )
    return prefix
