"""The job's errors: typed on both sides, each naming the mini-batch, pass, group or rank involved."""

from __future__ import annotations

from knitkit.types import UnitKey


class JobError(RuntimeError):
    """Base of every error the driver or a rank handle raises about the job itself."""


class DriverFailedError(JobError):
    """The driver failed (ranks: its message; driver calls: wraps the first failure)."""


class DriverDiedError(JobError):
    """Ranks: the driver process is gone (or stopped making progress) before finishing."""


class DriverNotFoundError(JobError, FileNotFoundError):
    """Ranks: the driver's rings are not in this node's /dev/shm (the driver is not running, or
    runs on another node); names the ring and the cause."""


class RankFailedError(JobError):
    """Driver: a writer rank raised inside a pass (its traceback travels here), died, or left
    through an exception or mid-pass; or no rank attached to a group within ``attach_timeout_s``."""


class NodeFailedError(JobError):
    """Driver: the control path to a node's ranks broke (its relay died with the node, its
    raylet or by itself); names the node, its ranks and the units that were lost with it."""

    def __init__(
        self,
        message: str,
        *,
        node: str = "",
        ranks: tuple[int, ...] = (),
        units: tuple[UnitKey, ...] = (),
    ) -> None:
        super().__init__(message)
        self.node = node
        """The lost node's id (``RayControl``: its Ray node id)."""
        self.ranks = ranks
        """The ranks that ran on it."""
        self.units = units
        """Units put from it that were lost with it (their trajectories must be re-written:
        the resumed driver's ``reissue()`` names them among the pending ones)."""


class ReorganizerFailedError(JobError):
    """Driver: a reorganizer of the pool failed or died; names its consumer group."""


class WriteBackMissingError(JobError):
    """A pass's write-back is incomplete: a rank finished it without writing every micro-batch's
    outputs, or the driver waited ``pass_timeout_s`` for fields a later pass reads."""
