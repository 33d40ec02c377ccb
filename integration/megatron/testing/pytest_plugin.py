"""pytest plugin: one line in ``conftest.py`` gives your tests the ``megatron_equivalence`` fixture.

::

    # conftest.py
    pytest_plugins = ["knitkit.integration.megatron.testing.pytest_plugin"]

    # test_my_model.py
    def test_dedup_wrap_keeps_gradients(megatron_equivalence):
        megatron_equivalence.check(VLMUnderTest(provider="my_pkg.model:provider",
            forward_step="my_pkg.model:forward_step"), "my_pkg.data:trajectories", tensor_parallel=2)

The fixture spawns worlds of ranks (gloo on CPU, NCCL with one GPU per rank when there are enough
GPUs), one per world size, kept for the whole session and shared by every check; a failing check
fails the test with the per-parameter table.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from knitkit.encoder_dedup import EquivalenceReport
from knitkit.integration.megatron.testing.job import CheckJob, run_job
from knitkit.integration.megatron.testing.subject import VLMUnderTest
from knitkit.integration.megatron.testing.world import World, default_backend


class EquivalenceChecker:
    """Runs ``CheckJob``s on spawned worlds; ``check`` asserts, ``report`` returns the report."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self._worlds: dict[int, World] = {}

    def check(
        self,
        subject: VLMUnderTest,
        trajectories: object,
        *,
        world_size: int | None = None,
        **options: object,
    ) -> EquivalenceReport:
        """``report(...)``, failing with the per-parameter table unless the wrap is equivalent."""
        report = self.report(subject, trajectories, world_size=world_size, **options)
        report.raise_if_failed()
        return report

    def report(
        self,
        subject: VLMUnderTest,
        trajectories: object,
        *,
        world_size: int | None = None,
        **options: object,
    ) -> EquivalenceReport:
        """Check ``subject`` on ``world_size`` ranks (default TP x PP x CP: DP=1); ``options`` are
        ``CheckJob`` fields (``tensor_parallel``, ``pipeline_parallel``, ``rtol``, ``floor``,
        ``python_path``, ...)."""
        job = CheckJob.of(subject, trajectories, **options)
        size = world_size or job.model_parallel
        return self._world(size).run(run_job, job, timeout_s=self.timeout_s)[0]

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()

    def _world(self, size: int) -> World:
        if size not in self._worlds:
            self._worlds[size] = World(
                size, backend=default_backend(size), timeout_s=self.timeout_s
            )
        return self._worlds[size]


@pytest.fixture(scope="session")
def megatron_equivalence() -> Iterator[EquivalenceChecker]:
    """Gradient-equivalence checks of a Megatron VLM under the dedup wrap, on spawned worlds."""
    checker = EquivalenceChecker()
    try:
        yield checker
    finally:
        checker.close()
