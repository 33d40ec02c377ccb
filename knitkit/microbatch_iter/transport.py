"""Transports: how staging slots are allocated, moved to the device, handed over and recycled."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from knitkit.microbatch_iter.host_register import HostRegistry

# NOTE [ Stream/event hand-off ]
# Slot s of the ring holds micro-batch j = s, s + S, s + 2S, ... (S = depth + refill slots). Each slot
# has a pinned host buffer, a device buffer allocated on the side stream, and two events:
#   h2d_done[s]  recorded on the side stream right after the one packed copy host -> device;
#   consumed[s]  recorded on the compute stream (the consumer's current stream) when the consumer
#                calls next() for micro-batch j + 1, i.e. after it enqueued every kernel of j.
# Hand-over (consumer thread, next()):  compute.wait_event(h2d_done[s]): a device-side wait, the
#   host never blocks; the kernels of j run after its bytes have landed.
# Refill of slot s with j + S (prefetch thread, before_refill):
#   1. h2d_done[s].synchronize(): host-side; the previous copy out of the pinned buffer is over,
#      so overwriting (or freeing, when the slot grows) the host buffer is safe. It is long done
#      in steady state; torch's pinned allocator cannot protect a buffer we overwrite in place.
#   2. side.wait_event(consumed[s]): device-side; the next copy into the device buffer runs
#      after the compute kernels that read j. consumed[s] was recorded before the credit that
#      lets the thread stage j + S was returned, so the event is never waited on before its record.
# Lifetimes without record_stream: device buffers are allocated on the side stream, and a buffer
#   is only dropped (slot growth, close) after step 2 enqueued the wait on consumed[s]. The
#   caching allocator hands a freed side-stream block only to later side-stream work, which is
#   ordered after that wait, hence after every kernel that read the block. close() enqueues the
#   same wait for every slot. Pinned host blocks freed on growth had their copy finished (step 1);
#   torch's host allocator also records an event for every non_blocking copy out of them.
# In-place copies (NOTE [ Registered source rings ]): the copy of j reads the source's published
#   slot itself, page-locked by registration; slot s then has no host buffer. The prefetch thread
#   hands the published slot back to the source only after h2d_done[s] completed (wait_copy), and
#   close() unregisters the source's mappings only after every h2d_done completed.


class Transport(Protocol):
    """Device-specific half of the iterator; slot indices name the ring's slots."""

    device: torch.device
    copies_to_device: bool
    """Whether the consumer reads a device copy (False: it reads the host buffer itself)."""
    h2d_seconds: float
    """Device time of finished host-to-device copies, when timing is on."""

    def enter_worker(self) -> None:
        """Per-thread setup, run first in the prefetch thread."""

    def new_host(self, nbytes: int) -> torch.Tensor: ...

    def new_device(self, nbytes: int, host: torch.Tensor | None) -> torch.Tensor:
        """A device buffer of ``nbytes`` for a slot whose host buffer is ``host`` (on CPU, the
        host buffer itself)."""
        ...

    def reads_in_place(self, view: np.ndarray) -> bool:
        """Whether the device copy may read ``view`` where it lies, with no host copy first (CUDA:
        its mapping is page-locked; NOTE [ Registered source rings ])."""
        ...

    def before_refill(self, slot: int) -> None: ...

    def to_device(
        self, slot: int, host: torch.Tensor, device: torch.Tensor, nbytes: int
    ) -> None: ...

    def wait_copy(self, slot: int) -> None:
        """Block until the slot's last host-to-device copy has finished reading its source."""

    def hand_over(self, slot: int) -> None:
        """Consumer side: order the consumer's work after the slot's device copy."""

    def release(self, slot: int) -> None:
        """Consumer side: the consumer has enqueued all its work on the slot's micro-batch."""

    def close(self) -> None: ...


class CpuTransport:
    """Host-only transport: the staged host buffer is what the consumer reads; no pinning, no events."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.copies_to_device = False
        self.h2d_seconds = 0.0

    def enter_worker(self) -> None:
        pass

    def new_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def new_device(self, nbytes: int, host: torch.Tensor | None) -> torch.Tensor:
        assert host is not None and host.numel() >= nbytes, "a CPU slot's device twin is its host"
        return host

    def reads_in_place(self, view: np.ndarray) -> bool:
        return False  # zero copy on CPU is a lease's private view (NOTE [ Zero-copy hand-off ])

    def before_refill(self, slot: int) -> None:
        pass

    def to_device(self, slot: int, host: torch.Tensor, device: torch.Tensor, nbytes: int) -> None:
        pass

    def wait_copy(self, slot: int) -> None:
        pass

    def hand_over(self, slot: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def close(self) -> None:
        pass


class CudaTransport:
    """One ``non_blocking`` copy per micro-batch on a side stream, from a pinned staging slot or
    from the source's page-locked slot itself; see NOTE [ Stream/event hand-off ]."""

    def __init__(
        self,
        device: torch.device,
        slots: int,
        *,
        time_h2d: bool = False,
        register_host: bool = True,
    ) -> None:
        self.device = device
        self.copies_to_device = True
        self.h2d_seconds = 0.0
        self.registry = HostRegistry() if register_host else None
        """Source mappings page-locked in place (NOTE [ Registered source rings ]); None: every
        micro-batch goes through a pinned staging slot."""
        # The side stream is created here, on the consumer's thread, never the compute stream.
        self.side = torch.cuda.Stream(device=device)
        self._h2d_done = [torch.cuda.Event(enable_timing=time_h2d) for _ in range(slots)]
        self._consumed = [torch.cuda.Event() for _ in range(slots)]
        self._h2d_start = (
            [torch.cuda.Event(enable_timing=True) for _ in range(slots)] if time_h2d else []
        )
        self._timed = [False] * slots

    def enter_worker(self) -> None:
        torch.cuda.set_device(self.device)

    def new_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def new_device(self, nbytes: int, host: torch.Tensor | None) -> torch.Tensor:
        with torch.cuda.stream(self.side):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def reads_in_place(self, view: np.ndarray) -> bool:
        return self.registry is not None and self.registry.page_locked(view)

    def before_refill(self, slot: int) -> None:
        self._h2d_done[slot].synchronize()
        self._collect_timing(slot)
        self.side.wait_event(self._consumed[slot])

    def to_device(self, slot: int, host: torch.Tensor, device: torch.Tensor, nbytes: int) -> None:
        with torch.cuda.stream(self.side):
            if self._h2d_start:
                self._h2d_start[slot].record(self.side)
                self._timed[slot] = True
            device[:nbytes].copy_(host[:nbytes], non_blocking=True)
            self._h2d_done[slot].record(self.side)

    def wait_copy(self, slot: int) -> None:
        self._h2d_done[slot].synchronize()

    def hand_over(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self._h2d_done[slot])

    def release(self, slot: int) -> None:
        self._consumed[slot].record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        for event in self._consumed:
            self.side.wait_event(event)
        for slot, done in enumerate(self._h2d_done):
            if self._timed[slot] or (self.registry is not None and self.registry.registered):
                done.synchronize()  # unregistering needs every copy out of the mappings done
                self._collect_timing(slot)
        if self.registry is not None:
            self.registry.close()

    def _collect_timing(self, slot: int) -> None:
        if self._timed[slot]:
            self._timed[slot] = False
            self.h2d_seconds += self._h2d_start[slot].elapsed_time(self._h2d_done[slot]) / 1e3


def make_transport(
    device: torch.device, slots: int, *, time_h2d: bool = False, register_host: bool = True
) -> Transport:
    """The transport for ``device``: CUDA streams and events on a GPU, the host-only path on CPU."""
    if device.type == "cuda":
        return CudaTransport(device, slots, time_h2d=time_h2d, register_host=register_host)
    if device.type == "cpu":
        return CpuTransport()
    raise ValueError(f"device {device} is not supported; use 'cuda', 'cuda:<index>' or 'cpu'")
