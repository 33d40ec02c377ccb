"""Backend factories for the storage contract suite, and helpers shared by the storage tests.

To run the ``UnitBackend`` contract suite (``test_backend_contract.py``) against another backend,
add a file ``tests/storage/backend_factories_<name>.py`` defining

    FACTORIES: dict[str, BackendFactory] = {"<name>": make_backend}

where ``make_backend(tmp_path)`` returns a fresh, empty backend (call ``pytest.skip`` inside it
when the engine is unavailable). The suite closes every backend it made. An optional
``FIXTURES: tuple[str, ...]`` in that file names fixtures set up before its factories run (an
engine the suite shares, e.g. ``local_ray``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.backends.disk import SafetensorsBackend
from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.backends.shm import SharedMemoryBackend

BackendFactory = Callable[[Path], UnitBackend]

LOCAL_BACKENDS = ("memory", "shm", "disk")
"""knitkit's own backends: tests of the layers above the backend seam run over these."""

BACKEND_FACTORIES: dict[str, BackendFactory] = {
    "memory": lambda tmp: MemoryBackend(),
    "shm": lambda tmp: SharedMemoryBackend(slab_bytes=1 << 20),
    "disk": lambda tmp: SafetensorsBackend(str(tmp / "shards"), shard_bytes=64 << 10),
}

FACTORY_FIXTURES: dict[str, tuple[str, ...]] = {}
"""Backend name -> the fixtures its factory needs first (its file's ``FIXTURES``)."""


def _load_extra_factories() -> None:
    for path in sorted(Path(__file__).parent.glob("backend_factories_*.py")):
        spec = importlib.util.spec_from_file_location(f"_knitkit_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        BACKEND_FACTORIES.update(module.FACTORIES)
        FACTORY_FIXTURES.update(dict.fromkeys(module.FACTORIES, getattr(module, "FIXTURES", ())))


_load_extra_factories()


@pytest.fixture(params=sorted(BACKEND_FACTORIES))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UnitBackend]:
    """A fresh backend of every registered kind."""
    for fixture in FACTORY_FIXTURES.get(request.param, ()):
        request.getfixturevalue(fixture)
    made = BACKEND_FACTORIES[request.param](tmp_path)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(params=LOCAL_BACKENDS)
def local_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UnitBackend]:
    """A fresh backend of each of knitkit's own kinds (the contract suite covers the others)."""
    made = BACKEND_FACTORIES[request.param](tmp_path)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private directory on /dev/shm's tmpfs: a sweep there sees the very segment and ring
    files (rings hard-linked into it, and their locks) without touching anyone else's /dev/shm."""
    path = f"/dev/shm/knitkit-test-{uuid.uuid4().hex}"
    os.mkdir(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
