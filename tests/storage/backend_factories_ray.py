"""The Ray object-store backend in the storage contract suite, on the session's local Ray runtime.

Starting Ray takes 5-15 s on this machine, so the backends run on the runtime the suite shares
(``local_ray`` in tests/conftest.py, requested through ``FIXTURES``) instead of one started and
shut down per module.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from knitkit.storage.backends.backend import UnitBackend

FIXTURES = ("local_ray",)
"""Fixtures the storage conftest sets up before this file's factories run."""


def make_backend(tmp: Path) -> UnitBackend:
    try:
        import ray
    except ImportError as error:
        pytest.skip(f"the Ray backend needs ray (pip install knitkit[ray]): {error}")
    # knitkit's own adapter imports outside the skip: a broken adapter is an error, not "no ray"
    from knitkit.integration.ray import RayBackend

    if not ray.is_initialized():
        raise RuntimeError("the Ray backend runs on the session's runtime: request local_ray")
    return RayBackend()


FACTORIES = {"ray": make_backend}
