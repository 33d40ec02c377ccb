"""``./dev.sh test`` says what needs root and goes on without Mooncake's system libraries."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _install_libs(tmp_path: Path, *, uid: int) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run dev.sh's ``install_mooncake_libs`` on a machine that lacks both libraries, as ``uid``.

    Root and the package manager cannot be changed by a test: ``id``, ``ldconfig`` and
    ``apt-get`` are stand-ins on ``PATH`` (the last one records that it ran and fails, as it
    does without root or network); the function itself is dev.sh's own text.
    """
    source = (ROOT / "dev.sh").read_text()
    function = re.search(r"^install_mooncake_libs\(\) \{\n.*?^\}\n", source, re.S | re.M)
    assert function, "dev.sh has no install_mooncake_libs function"
    bin_dir, ran = tmp_path / "bin", tmp_path / "apt-get-ran"
    bin_dir.mkdir()
    stubs = {
        "id": f'[ "$1" = -u ] && echo {uid}',
        "ldconfig": "echo '1 libs found in cache'",
        "apt-get": f'echo "$@" >> {ran}; exit 100',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = f"set -euo pipefail\n{function.group(0)}install_mooncake_libs\necho done\n"
    done = subprocess.run(
        ["bash", "-c", script],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done, ran


def test_without_root_it_says_what_needs_root_and_goes_on(tmp_path: Path) -> None:
    """Not root, libibverbs1 and libnuma1 missing: no apt-get, one line naming the packages, the
    root command and that the Mooncake tests will be skipped; the setup goes on (exit 0)."""
    done, ran = _install_libs(tmp_path, uid=1000)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    assert not ran.exists(), f"apt-get ran without root: {ran.read_text()}"
    assert "sudo apt-get install libibverbs1 libnuma1" in done.stderr, done.stderr
    assert "needs root" in done.stderr and "skipped" in done.stderr, done.stderr


def test_as_root_it_says_it_installs_and_goes_on_when_that_fails(tmp_path: Path) -> None:
    """Root: it says it runs apt-get before it does; when apt-get fails it says so, and that the
    Mooncake tests will be skipped, and the setup goes on."""
    done, ran = _install_libs(tmp_path, uid=0)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    assert ran.exists()
    announce, failed = done.stderr.splitlines()
    assert "installing libibverbs1 libnuma1" in announce and "root" in announce, done.stderr
    assert "failed" in failed and "skipped" in failed, done.stderr
