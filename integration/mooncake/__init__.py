"""knitkit.integration.mooncake: a backend on Mooncake's store, and a local master to run it against."""

from .backend import MooncakeBackend
from .master import MasterAddress, MooncakeMaster

__all__ = ["MasterAddress", "MooncakeBackend", "MooncakeMaster"]
