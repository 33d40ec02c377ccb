"""Test-suite setup shared by every part."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dist import World, lend
from example_checks import GrpoRun, run_grpo_reference

SHARED_WORLDS = {"gloo_world2": 2, "gloo_world4": 4}
"""The suite's shared gloo worlds, fixture name -> size (NOTE [ One gloo world per size for the
suite ] in tests/dist.py)."""
WORLD_TIMEOUT_S = 180.0
"""Default limit of one ``run`` on a lent world, unless the module sets ``WORLD_TIMEOUT_S``."""
_OPEN_WORLDS: dict[str, World] = {}
_LAST_USERS: dict[str, pytest.Item] = {}


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


def _shared_world(name: str) -> Iterator[World]:
    with World(SHARED_WORLDS[name]) as world:
        _OPEN_WORLDS[name] = world
        yield world
        _OPEN_WORLDS.pop(name, None)


@pytest.fixture(scope="session")
def gloo_world2() -> Iterator[World]:
    """The suite's gloo world of 2 ranks: a module borrows it with ``dist.lend``."""
    yield from _shared_world("gloo_world2")


@pytest.fixture(scope="session")
def gloo_world4() -> Iterator[World]:
    """The suite's gloo world of 4 ranks: a module borrows it with ``dist.lend``."""
    yield from _shared_world("gloo_world4")


@pytest.fixture(scope="module")
def world2(request: pytest.FixtureRequest, gloo_world2: World) -> Iterator[World]:
    """The suite's world of 2, lent to this module (``dist.lend``)."""
    with lend(gloo_world2, _world_timeout_s(request)) as world:
        yield world


@pytest.fixture(scope="module")
def world4(request: pytest.FixtureRequest, gloo_world4: World) -> Iterator[World]:
    """The suite's world of 4, lent to this module (``dist.lend``)."""
    with lend(gloo_world4, _world_timeout_s(request)) as world:
        yield world


def _world_timeout_s(request: pytest.FixtureRequest) -> float:
    return float(getattr(request.module, "WORLD_TIMEOUT_S", WORLD_TIMEOUT_S))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note the last test that uses each shared world (``pytest_runtest_teardown`` closes it)."""
    for item in session.items:
        for name in SHARED_WORLDS:
            if name in getattr(item, "fixturenames", ()):
                _LAST_USERS[name] = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Close a shared world once its last test is done, so its idle ranks do not outlive the
    tests that use them (a later ``run`` would start it afresh)."""
    for name, last in _LAST_USERS.items():
        if item is last and name in _OPEN_WORLDS:
            _OPEN_WORLDS[name].close()
