"""The Mooncake store backend in the storage contract suite, each against a master it starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from knitkit.storage.backends.backend import UnitBackend


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

    class SelfHostedMooncakeBackend(MooncakeBackend):
        """A ``MooncakeBackend`` that stops the master it started when closed."""

        def close(self) -> None:
            try:
                super().close()
            finally:
                master.stop()

    master = MooncakeMaster(log_path=str(tmp / "mooncake_master.log"))
    # one node, loopback: opt in to Mooncake's wildcard listeners (integration/mooncake/README.md)
    return SelfHostedMooncakeBackend(
        master.start(), segment_bytes=64 << 20, allow_wildcard_listeners=True
    )


FACTORIES = {"mooncake": make_backend}
