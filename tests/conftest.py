"""Test-suite setup shared by every part."""

from __future__ import annotations

import pytest
from example_checks import GrpoRun, run_grpo_reference


@pytest.fixture(scope="session")
def grpo_reference_run(tmp_path_factory: pytest.TempPathFactory) -> GrpoRun:
    """The GRPO example's uninterrupted run, launched once for the suite: the example's test
    (knitkit vs the plain loop, its printed lines and figures) and the kill/resume test (the
    run it must equal) both read it (``run_grpo_reference``)."""
    return run_grpo_reference(tmp_path_factory.mktemp("grpo-reference"))
