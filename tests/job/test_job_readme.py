"""The knitkit.job README's example runs as it is written (extracted and run as a script)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "knitkit" / "job" / "README.md"


def test_the_readme_example_runs(tmp_path: Path) -> None:
    """The example under "Example (runs as is)": a driver, two ranks, two passes; it finishes
    with every admitted mini-batch released (its last line is the progress)."""
    section = README.read_text().split("## Example (runs as is)", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the Example section has no python block"
    script = tmp_path / "job_example.py"
    script.write_text(code.group(1))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[:2] == ["1", "2"], done.stdout
    assert lines[-1].startswith("Progress(admitted=2, released=2,"), done.stdout
