"""Spawned gloo worlds shared by this package's multi-process tests (started once, reused by every case)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dist import World


@pytest.fixture(scope="package")
def world2() -> Iterator[World]:
    with World(2, timeout_s=180) as world:
        yield world


@pytest.fixture(scope="package")
def world4() -> Iterator[World]:
    with World(4, timeout_s=180) as world:
        yield world
