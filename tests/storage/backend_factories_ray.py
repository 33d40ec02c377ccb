"""The Ray object-store backend in the storage contract suite, on a local Ray instance.

Starting Ray takes 5-15 s on this machine, so the first Ray backend starts one instance
(``num_cpus=4``, as TransferQueue needs) and leaves it up for the rest of the session; Ray shuts
it down at exit. A test that needs its own instance must check ``ray.is_initialized()`` first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from knitkit.storage.backend import UnitBackend


def make_backend(tmp: Path) -> UnitBackend:
    try:
        import ray
        from knitkit.integration.ray import RayBackend
    except ImportError as error:
        pytest.skip(f"the Ray backend needs ray (pip install knitkit[ray]): {error}")
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    return RayBackend()


FACTORIES = {"ray": make_backend}
