"""The job's errors: typed on both sides, each naming the mini-batch, pass, group or rank involved."""

from __future__ import annotations

from knitkit.storage import ReorganizerDiedError, ReorganizerError
from knitkit.types import UnitKey

PRODUCER_CAUSE = "producer"
"""A rank's ``error`` record's ``cause`` when a reorganizer's failure or death made it raise."""


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

    def __init__(self, message: str, *, producer_failed: bool = False) -> None:
        super().__init__(message)
        self.producer_failed = producer_failed
        """The rank raised because a reorganizer feeding it failed or died: the driver waits
        for its pool to name that cause (NOTE [ A rank's producer failure ] in core.py)."""


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

    def __init__(self, message: str, *, unreachable_node: str = "") -> None:
        super().__init__(message)
        self.unreachable_node = unreachable_node
        """The node whose connection to the reorganizer broke (Ray: a call ended unreachable,
        so the node may be lost), else ``""``: the control plane's diagnosis names that node's
        loss (NOTE [ One error for a lost node ] in integration/ray/relay.py)."""


class WriteBackMissingError(JobError):
    """A pass's write-back is incomplete: a rank finished it without writing every micro-batch's
    outputs, or the driver waited ``pass_timeout_s`` for fields a later pass reads."""


def producer_failed(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from or while handling (as a traceback shows
    them), is a data ring's report that its reorganizer failed or died."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, ReorganizerDiedError | ReorganizerError):
            return True
        seen.add(id(current))
        suppressed = current.__suppress_context__
        current = current.__cause__ or (None if suppressed else current.__context__)
    return False
