"""The staging pool: a fixed ring of reusable host (pinned on CUDA) and device buffers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from knitkit.microbatch_iter.batch import ViewCache
from knitkit.microbatch_iter.transport import Transport


@dataclass(slots=True)
class StagingSlot:
    """One slot of the ring: a flat host buffer and its device twin (the same tensor on CPU)."""

    index: int
    host: torch.Tensor | None = None
    device: torch.Tensor | None = None
    array: np.ndarray | None = None
    """``host`` as a numpy array (the staging copy's target), made once per buffer."""
    views: ViewCache = field(default_factory=ViewCache)
    """Field views of ``device``, reused while the layout repeats (NOTE [ Reused field views ])."""

    @property
    def capacity(self) -> int:
        return 0 if self.host is None else self.host.numel()


class StagingRing:
    """The iterator's staging buffers: ``count`` slots used round robin, micro-batch ``j`` in
    slot ``j % count`` (not the shared-memory ``knitkit.storage.SlotRing`` it may read from).

    A slot grows to the next power of two when a larger micro-batch arrives and is otherwise
    reused as is, so variable-size micro-batches allocate (and pin) at most about
    ``log2(max / min)`` times per slot, and never again once the largest size has been seen.
    Growth happens only inside a refill, after the transport's waits (NOTE [ Stream/event
    hand-off ]), so a buffer is never freed while a copy or a kernel may still read it.
    """

    def __init__(self, count: int, transport: Transport, initial_nbytes: int = 0) -> None:
        if count < 1:
            raise ValueError(f"a slot ring needs at least one slot, got count={count}")
        self.transport = transport
        self.slots = [StagingSlot(i) for i in range(count)]
        self.allocations = 0
        """Host buffers allocated so far (each one page-locked on CUDA)."""
        if initial_nbytes > 0:
            for slot in self.slots:
                self.ensure(slot, initial_nbytes)

    def slot_for(self, index: int) -> StagingSlot:
        return self.slots[index % len(self.slots)]

    def ensure(self, slot: StagingSlot, nbytes: int, *, host: bool = True) -> None:
        """Grow ``slot`` to hold ``nbytes``; call only once the slot may be refilled.

        ``host=False`` grows the device buffer only: the device copy reads the source's
        page-locked slot in place (NOTE [ Registered source rings ]).
        """
        size = 1 << max(nbytes - 1, 0).bit_length()
        if host and (slot.host is None or slot.capacity < nbytes):
            slot.views.clear()
            slot.host = slot.array = None
            slot.device = None  # on CPU the device twin is the host buffer itself
            slot.host = self.transport.new_host(size)
            slot.array = slot.host.numpy()
            self.allocations += 1
        if slot.device is None or slot.device.numel() < nbytes:
            slot.views.clear()
            slot.device = None
            slot.device = self.transport.new_device(max(size, slot.capacity), slot.host)

    @property
    def held_bytes(self) -> int:
        """Host plus device bytes held by the ring (a CPU slot's device twin is its host buffer)."""
        total = 0
        for slot in self.slots:
            if slot.host is not None:
                total += slot.host.numel()
            if slot.device is not None and slot.device is not slot.host:
                total += slot.device.numel()
        return total

    def clear(self) -> None:
        for slot in self.slots:
            slot.views.clear()
            slot.host = slot.array = None
            slot.device = None
