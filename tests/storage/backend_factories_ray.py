"""The Ray object-store backend in the storage contract suite, on a local Ray instance.

Starting Ray takes 5-15 s on this machine, so the first Ray backend of a test module starts one
instance and ``teardown()`` (run by conftest.py after the module) shuts it down again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from knitkit.storage.backends.backend import UnitBackend

_started = False


def make_backend(tmp: Path) -> UnitBackend:
    global _started
    try:
        import ray
    except ImportError as error:
        pytest.skip(f"the Ray backend needs ray (pip install knitkit[ray]): {error}")
    # knitkit's own adapter imports outside the skip: a broken adapter is an error, not "no ray"
    from knitkit.integration.ray import RayBackend, start_ray

    if not ray.is_initialized():
        start_ray(num_cpus=2, logging_level="ERROR")
        _started = True
    return RayBackend()


def teardown() -> None:
    global _started
    if _started:
        import ray

        ray.shutdown()
        _started = False


FACTORIES = {"ray": make_backend}
