"""knitkit.integration.mooncake: a backend on Mooncake's store, and a local master to run it against."""

from knitkit.integration.mooncake.backend import MooncakeBackend
from knitkit.integration.mooncake.master import MasterAddress, MooncakeMaster

__all__ = ["MasterAddress", "MooncakeBackend", "MooncakeMaster"]
