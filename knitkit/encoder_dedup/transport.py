"""Row transports: the one collective the dedup routing needs (an uneven all-to-all of encoding rows)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class RowTransport(Protocol):
    """Exchanges rows of a 2-D tensor with every peer: ``send_counts[p]`` rows go to peer ``p``."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def exchange(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        *,
        timeout_s: float | None = None,
    ) -> torch.Tensor:
        """Send ``send`` (rows grouped by peer); return the received rows grouped by peer.

        With ``timeout_s``, raise ``TimeoutError`` if the peers have not all joined by then.
        """
        ...


@dataclass(frozen=True, slots=True)
class LocalTransport:
    """A world of one: everything a rank sends arrives back at itself."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def exchange(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        *,
        timeout_s: float | None = None,
    ) -> torch.Tensor:
        if list(send_counts) != list(recv_counts):
            raise ValueError(
                f"a single rank must receive what it sends: {send_counts} vs {recv_counts}"
            )
        return send


@dataclass(frozen=True, slots=True)
class ProcessGroupTransport:
    """``torch.distributed.all_to_all_single`` over a process group (gloo on CPU, NCCL on GPU).

    Plan ranks are ranks within ``group``; every rank of the group must call ``exchange`` together.
    """

    group: dist.ProcessGroup | None = None
    """``None`` is the default (world) group."""

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def exchange(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        *,
        timeout_s: float | None = None,
    ) -> torch.Tensor:
        if len(send_counts) != self.world_size or len(recv_counts) != self.world_size:
            raise ValueError(
                f"counts for {len(send_counts)}/{len(recv_counts)} peers in a group of "
                f"{self.world_size}; build the routing plan with world_size={self.world_size}"
            )
        if sum(send_counts) != len(send):
            raise ValueError(f"send_counts {list(send_counts)} do not add up to {len(send)} rows")
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        work = dist.all_to_all_single(
            recv,
            send.contiguous(),
            list(recv_counts),
            list(send_counts),
            group=self.group,
            async_op=timeout_s is not None,
        )
        if work is not None:
            _wait(work, timeout_s or 0.0)
        return recv


def _wait(work: dist.Work, timeout_s: float) -> None:
    """Wait for ``work`` (polling, so the bound holds on every backend); TimeoutError past it."""
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"collective not complete after {timeout_s:g} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    work.wait()
