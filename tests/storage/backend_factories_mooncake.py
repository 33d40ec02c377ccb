"""The Mooncake store backend in the storage contract suite: a namespace per test on one client.

A Mooncake client takes 2-3 s to close (NOTE [ Namespaces on one client ] in
integration/mooncake/backend.py), so the suite starts one master and one client for the whole
session and gives each test a fresh namespace on it (``MooncakeBackend.with_namespace``); the
suite's close of each test's backend removes that namespace's units. The client and the master
stop when the interpreter exits.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

import pytest

from knitkit.storage.backends.backend import UnitBackend

_SHARED: list[Any] = []
"""The session's one client (a ``MooncakeBackend`` of no test's namespace), once started."""


def make_backend(tmp: Path) -> UnitBackend:
    try:
        import mooncake.engine  # the engine the adapter loads
        import mooncake.store  # noqa: F401
    except ImportError as error:
        pytest.skip(
            f"needs mooncake-transfer-engine-non-cuda and libibverbs1 (./dev.sh test): {error}"
        )
    # knitkit's own adapter imports outside the skip: a broken adapter is an error, not a skip
    from knitkit.integration.mooncake import MooncakeBackend, MooncakeMaster

    if not _SHARED:
        master = MooncakeMaster(log_path=str(tmp / "mooncake_master.log"))
        client = MooncakeBackend(
            master.start(), segment_bytes=64 << 20, allow_wildcard_listeners=True
        )
        _SHARED.append(client)
        atexit.register(master.stop)  # runs after the client's close (registered last, runs first)
        atexit.register(client.close)
    return _SHARED[0].with_namespace()


FACTORIES = {"mooncake": make_backend}
