"""Row transports: the one collective the dedup routing needs (an uneven all-to-all of encoding rows)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
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
    """Point-to-point row exchange over a process group (gloo on CPU, NCCL on GPU).

    Plan ranks are ranks within ``group``; every rank of the group must call ``exchange`` together.
    See NOTE [ Rows travel point to point ] and NOTE [ The group read once ].
    """

    group: dist.ProcessGroup | None = None
    """``None`` is the default (world) group."""
    _peers: tuple[int, int, tuple[int, ...]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    """(rank, world size, each group rank's global rank), read from the group on first use."""

    @property
    def rank(self) -> int:
        return self._layout()[0]

    @property
    def world_size(self) -> int:
        return self._layout()[1]

    # NOTE [ The group read once ]: a transport's rank, size and its peers' global ranks are
    # fixed for the life of its group, yet every dedup phase asked torch for them again (about
    # 11 ``get_rank`` / ``get_world_size`` calls and one ``get_global_rank`` per peer and
    # exchange, each a few Python frames deep in ``distributed_c10d``). They are read on first
    # use and kept.
    def _layout(self) -> tuple[int, int, tuple[int, ...]]:
        if self._peers is None:
            size = dist.get_world_size(self.group)
            targets = tuple(
                peer if self.group is None else dist.get_global_rank(self.group, peer)
                for peer in range(size)
            )
            object.__setattr__(self, "_peers", (dist.get_rank(self.group), size, targets))
        assert self._peers is not None
        return self._peers

    def exchange(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        *,
        timeout_s: float | None = None,
    ) -> torch.Tensor:
        """Send ``send`` (rows grouped by peer); return the received rows grouped by peer.

        With ``timeout_s``, raise ``ExchangeTimeout`` naming the peers whose rows had not arrived
        by then; a failed link raises ``RuntimeError`` naming the peer.
        """
        me, size, targets = self._layout()
        if len(send_counts) != size or len(recv_counts) != size:
            raise ValueError(
                f"counts for {len(send_counts)}/{len(recv_counts)} peers in a group of "
                f"{size}; build the routing plan with world_size={size}"
            )
        if sum(send_counts) != len(send):
            raise ValueError(f"send_counts {list(send_counts)} do not add up to {len(send)} rows")
        if send_counts[me] != recv_counts[me]:
            raise ValueError(
                f"rank {me} sends itself {send_counts[me]} rows but expects {recv_counts[me]}"
            )
        send = send.contiguous()
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        outgoing = send.split(list(send_counts))
        incoming = recv.split(list(recv_counts))
        if recv_counts[me]:
            incoming[me].copy_(outgoing[me])
        ops: list[dist.P2POp] = []
        peers: list[int] = []
        for peer in range(size):  # see NOTE [ Rows travel point to point ]
            if peer == me:
                continue
            if send_counts[peer]:
                ops.append(dist.P2POp(dist.isend, outgoing[peer], targets[peer], self.group))
                peers.append(peer)
            if recv_counts[peer]:
                ops.append(dist.P2POp(dist.irecv, incoming[peer], targets[peer], self.group))
                peers.append(peer)
        if ops:
            works = dist.batch_isend_irecv(ops)
            exact = len(works) == len(ops)  # one work per op; else the backend fused them
            owners: list[tuple[int, ...]] = (
                [(p,) for p in peers] if exact else [tuple(sorted(set(peers)))] * len(works)
            )
            _wait(works, owners, timeout_s, polled=send.is_cuda, exact=exact)
        return recv


def gather_rows(
    row: torch.Tensor, group: dist.ProcessGroup | None = None, *, timeout_s: float
) -> torch.Tensor:
    """Every rank's ``row`` (``[1, width]``) in rank order: one all-gather, bounded by ``timeout_s``.

    For what every rank tells every other alike: a ring or tree, not a connection per pair of
    ranks (NCCL would set up buffers for each). A timeout cannot name the late rank.
    """
    out = row.new_empty((dist.get_world_size(group), *row.shape[1:]))
    work = dist.all_gather_into_tensor(out, row.contiguous(), group=group, async_op=True)
    assert work is not None
    _wait([work], [()], timeout_s, polled=row.is_cuda, exact=False)
    return out


class ExchangeTimeout(TimeoutError):
    """An exchange did not complete in time; ``peers`` are the ranks (of the group) still pending."""

    def __init__(self, message: str, peers: tuple[int, ...], exact: bool) -> None:
        super().__init__(message)
        self.peers = peers
        """Ranks whose rows had not arrived (or not left) when the bound passed."""
        self.exact = exact
        """False where the backend completes all peers together (NCCL): one of ``peers`` is late."""


# NOTE [ Rows travel point to point ]: ``exchange`` posts one send and one receive per peer it
# shares rows with (``batch_isend_irecv``: NCCL fuses them into one group call, which is how
# torch implements its all-to-all there; gloo runs them one by one) and skips peers with nothing
# to move. Unlike one opaque all-to-all, a receive that has not completed names its peer: a bounded
# wait can say WHICH rank never arrived (``ExchangeTimeout.peers``; with NCCL's single fused work
# all pending peers are named together), and a dropped link names the peer it linked to. A
# handshake (``agreement.py``) precedes every exchange of routed rows, so message sizes always
# match. After a timeout the receives stay posted: the group is unusable and the run must stop.


def _wait(
    works: list[dist.Work],
    owners: list[tuple[int, ...]],
    timeout_s: float | None,
    *,
    polled: bool,
    exact: bool,
) -> None:
    """Wait for ``works`` (``owners[i]``: the peers of work ``i``), within ``timeout_s`` if given.

    Works on CUDA tensors (NCCL) complete on the GPU and ``wait`` does not block the host, so the
    host sleeps on their completion event (see NOTE [ Host waits for GPU exchanges ]); gloo's
    point-to-point works on the CPU complete only inside ``wait``, which takes the bound itself.
    See NOTE [ Rows travel point to point ].
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    if polled and timeout_s is not None and not _completed_within(works, timeout_s):
        late = [o for w, o in zip(works, owners, strict=True) if not w.is_completed()]
        raise _timeout(late, timeout_s, exact)
    late = []
    for work, owner in zip(works, owners, strict=True):
        try:
            if deadline is None or polled:
                work.wait()
            else:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        except RuntimeError as error:
            if deadline is None or deadline - time.monotonic() > _SLACK_S:
                raise RuntimeError(
                    f"exchange with rank(s) {list(owner)} failed: {error}"
                ) from error
            late.append(owner)  # gloo raises when the bound passes
    if late:
        raise _timeout(late, timeout_s, exact)


# NOTE [ Host waits for GPU exchanges ]: a bounded host wait for NCCL works sleeps until the GPU
# signals, instead of polling ``is_completed`` with a back-off (which woke up to 50 ms late, about
# five times per pass, while no GPU work was queued behind the exchange). The current stream waits
# for the works (``work.wait()``, no host block), a blocking-sync CUDA event recorded behind them
# is synchronized in a short-lived daemon thread (``knitkit-exchange-wait``: the CUDA driver puts
# it to sleep until the event fires, without the GIL), and the caller waits on a
# ``threading.Event`` with the bound, so it wakes when the rows land or when the bound passes,
# whichever is first. After a timeout the thread stays blocked on the event; as NOTE [ Rows travel
# point to point ] says, the group is then unusable and the run must stop. One thread per bounded
# GPU exchange (tens of microseconds) against a collective that crosses the GPU: docs/lifecycle.md.


def _completed_within(works: list[dist.Work], timeout_s: float) -> bool:
    """Whether CUDA ``works`` complete within ``timeout_s``, sleeping on their completion event
    meanwhile (see NOTE [ Host waits for GPU exchanges ])."""
    if all(work.is_completed() for work in works):
        return True
    for work in works:
        work.wait()  # the current stream waits for the exchange; the host does not
    landed = torch.cuda.Event(blocking=True)
    landed.record()
    signalled = threading.Event()

    def watch() -> None:
        landed.synchronize()
        signalled.set()

    threading.Thread(target=watch, name="knitkit-exchange-wait", daemon=True).start()
    return signalled.wait(timeout_s)


_SLACK_S = 0.05
"""gloo rounds a wait's bound to milliseconds: a wait that raises this close to the deadline timed out."""


def _timeout(late: list[tuple[int, ...]], timeout_s: float | None, exact: bool) -> ExchangeTimeout:
    peers = tuple(sorted({p for owner in late for p in owner}))
    if not peers:  # a collective: who is late is not known
        return ExchangeTimeout(f"not every rank joined within {timeout_s:g} s", peers, exact)
    return ExchangeTimeout(
        f"no rows from or to rank(s) {list(peers)} after {timeout_s:g} s", peers, exact
    )
