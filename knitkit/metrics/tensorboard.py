"""TensorBoardObserver: each step's figures as TensorBoard scalars, through ``torch.utils.tensorboard``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from knitkit.metrics.observer import ClosingObserver, checked

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

EXTRA = "knitkit[tensorboard]"


class TensorBoardObserver(ClosingObserver):
    """Writes every figure as a scalar tagged with its name (``knitkit/storage/units_live``) at ``step``.

    Give a ``log_dir`` (created owner-only if missing; closed by ``close``), or the trainer's own
    ``writer`` so knitkit's figures land in the same run (left open: it is the trainer's).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        writer: SummaryWriter | None = None,
        flush_secs: int = 30,
    ) -> None:
        if (log_dir is None) == (writer is None):
            raise ValueError("TensorBoardObserver takes a log_dir or a writer, exactly one")
        if writer is None:
            writer = summary_writer(log_dir, flush_secs)  # type: ignore[arg-type]
            self._owned = True
        else:
            self._owned = False
        self.writer = writer

    def __call__(self, step: int, metrics: Mapping[str, float], /) -> None:
        for name, value in checked(metrics).items():
            self.writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Flush; close the writer if this observer made it (idempotent)."""
        if self._owned:
            self.writer.close()
        else:
            self.writer.flush()


def summary_writer(log_dir: str | os.PathLike[str], flush_secs: int) -> SummaryWriter:
    """A ``SummaryWriter`` on ``log_dir``; a clear error naming the extra when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            f"TensorBoardObserver needs the tensorboard package ({error}): "
            f"pip install '{EXTRA}', or log with JsonlObserver instead"
        ) from error
    os.makedirs(log_dir, mode=0o700, exist_ok=True)
    return SummaryWriter(log_dir=os.fspath(log_dir), flush_secs=flush_secs)
