"""Test-suite setup shared by every part."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from example_checks import GrpoRun, run_grpo_reference


@pytest.fixture(scope="session")
def grpo_reference_run(tmp_path_factory: pytest.TempPathFactory) -> GrpoRun:
    """The GRPO example's uninterrupted run, launched once for the suite: the example's test
    (knitkit vs the plain loop, its printed lines and figures) and the kill/resume test (the
    run it must equal) both read it (``run_grpo_reference``)."""
    return run_grpo_reference(tmp_path_factory.mktemp("grpo-reference"))


@pytest.fixture(scope="session")
def _local_ray_address() -> Iterator[list[str]]:
    """The GCS address of the runtime ``local_ray`` started, if any; that runtime is shut down
    with the session when it is still the one up."""
    started: list[str] = []
    yield started
    if started:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().gcs_address == started[0]:
            ray.shutdown()


@pytest.fixture
def local_ray(_local_ray_address: list[str]) -> None:
    """A local loopback Ray runtime (``start_ray(num_cpus=2)``) for tests that only need one to
    run on, shared across modules: started unless the one ``local_ray`` started is still up (a
    module that needs its own runtime shuts down whatever is up first), left running for the next
    test, shut down with the session. One Ray start and shutdown less per module that would
    start this same runtime itself (tests/job/test_ray_pool.py, tests/job/test_recovery.py)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'knitkit[ray]')")
    from knitkit.integration.ray import start_ray

    if ray.is_initialized():
        if ray.get_runtime_context().gcs_address in _local_ray_address:
            return
        ray.shutdown()
    start_ray(num_cpus=2, logging_level="ERROR")
    _local_ray_address[:] = [ray.get_runtime_context().gcs_address]
