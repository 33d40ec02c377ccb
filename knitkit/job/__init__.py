"""knitkit.job: one driver handle and one per-rank handle for a whole RL step of several passes.

Glue level, like the demo: it imports the parts only through their faces and no part imports it.
The driver (one process) owns the store, admission, the planner and the reorganizers; each
training rank holds a ``RankHandle`` built from the driver's ``RankSpec``.
"""

from knitkit.job.broadcast import broadcast_rank_spec
from knitkit.job.control import ControlLayout, ControlPlane, LocalControl
from knitkit.job.driver import Driver
from knitkit.job.errors import (
    DriverDiedError,
    DriverFailedError,
    DriverNotFoundError,
    JobError,
    NodeFailedError,
    RankFailedError,
    ReorganizerFailedError,
    WriteBackMissingError,
)
from knitkit.job.ledger import MiniBatchLedger, PassLedger, Progress
from knitkit.job.passes import Output, Pass
from knitkit.job.pool import ProcessPool, ReorganizerPool
from knitkit.job.rank import RankHandle
from knitkit.job.spec import RankCoords, RankSpec
from knitkit.job.work import PassWork

__all__ = [
    "ControlLayout",
    "ControlPlane",
    "Driver",
    "DriverDiedError",
    "DriverFailedError",
    "DriverNotFoundError",
    "JobError",
    "LocalControl",
    "MiniBatchLedger",
    "NodeFailedError",
    "Output",
    "Pass",
    "PassLedger",
    "PassWork",
    "ProcessPool",
    "Progress",
    "RankCoords",
    "RankFailedError",
    "RankHandle",
    "RankSpec",
    "ReorganizerFailedError",
    "ReorganizerPool",
    "WriteBackMissingError",
    "broadcast_rank_spec",
]
