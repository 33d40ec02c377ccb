"""Page-lock a source's shared-memory ring where it lies (cudaHostRegister), once per mapping."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)

_PORTABLE = 0x01  # cudaHostRegisterPortable: page-locked for every CUDA context
_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads (needed for r--s mappings)
_PRIVATE_LOOKUPS = 8
"""Refused mappings looked up (in /proc/self/maps) before a registry that registered nothing
stops looking: a source of fresh arrays lands in a new private mapping every time."""

# NOTE [ Registered source rings ]
# A published slot (a reorganizer's /dev/shm ring) can be the source of the device copy itself
# once its pages are page-locked: cudaHostRegister on the whole shared mapping that holds it,
# once, the first time a slot of that mapping arrives (a ring's slots share one mapping).
# - Only shared mappings (MAP_SHARED: /dev/shm, memfd) are registered: they stay mapped while
#   their source lives. Private memory (the heap, numpy arrays) is never registered: an
#   allocator may unmap or reuse it while it is page-locked.
# - The source must keep its buffers mapped until the iterator is closed; a MicroBatchConsumer
#   given to the iterator is closed by it after teardown, which unregisters first. Over a
#   consumer's take(n) the consumer outlives the iterator and stays mapped; each iterator
#   registers the ring anew (once per iterator) and unregisters it at its close.
# - Registration can fail (no CUDA, a mapping another user already registered, a read-only
#   mapping on a device without read-only registration, a locked-memory limit): the mapping is
#   remembered as refused, one line is logged, and its slots go through a pinned staging slot.
# - Unregistering needs every copy out of the mapping to be finished: the transport waits for
#   its copies' events before ``close()`` unregisters (NOTE [ Stream/event hand-off ]).


@dataclass(frozen=True, slots=True)
class MappedRegion:
    """One line of ``/proc/self/maps``: ``[start, end)``, its permissions and backing path."""

    start: int
    end: int
    perms: str
    path: str

    @property
    def shared(self) -> bool:
        return self.perms[3:4] == "s"

    @property
    def writable(self) -> bool:
        return "w" in self.perms

    def holds(self, address: int, nbytes: int) -> bool:
        return self.start <= address and address + nbytes <= self.end


def mapping_of(address: int) -> MappedRegion | None:
    """The mapping of this process that holds ``address`` (None off Linux or if unmapped)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                bounds, perms, _offset, _dev, _inode, *path = line.split(maxsplit=5)
                low, high = (int(bound, 16) for bound in bounds.split("-"))
                if low <= address < high:
                    return MappedRegion(low, high, perms, path[0].strip() if path else "")
    except OSError:
        return None
    return None


class PageLocker(Protocol):
    """The two CUDA runtime calls a ``HostRegistry`` needs; each returns a CUDA error code."""

    def register(self, address: int, nbytes: int, *, read_only: bool) -> int: ...

    def unregister(self, address: int) -> int: ...

    def describe(self, code: int) -> str:
        """The CUDA error name of ``code``, for log lines."""
        ...


class CudartPageLocker:
    """``torch.cuda.cudart()``'s cudaHostRegister / cudaHostUnregister."""

    def register(self, address: int, nbytes: int, *, read_only: bool) -> int:
        flags = _PORTABLE | (_READ_ONLY if read_only else 0)
        return _consumed(int(torch.cuda.cudart().cudaHostRegister(address, nbytes, flags)))

    def unregister(self, address: int) -> int:
        return _consumed(int(torch.cuda.cudart().cudaHostUnregister(address)))

    def describe(self, code: int) -> str:
        cudart = torch.cuda.cudart()
        return f"{cudart.cudaGetErrorString(cudart.cudaError(code))} ({code})"


class HostRegistry:
    """The shared mappings one iterator has page-locked; see NOTE [ Registered source rings ]."""

    def __init__(self, locker: PageLocker | None = None) -> None:
        self._locker = locker if locker is not None else CudartPageLocker()
        self.registered: list[MappedRegion] = []
        """Mappings page-locked by this registry, unregistered by ``close()``."""
        self.refused: list[MappedRegion] = []
        """Mappings that are not registered (private, or registration failed); logged once."""

    def page_locked(self, view: np.ndarray) -> bool:
        """Whether ``view``'s bytes lie in a mapping this registry page-locked, registering the
        mapping that holds them the first time one of its slots is seen."""
        address = int(view.__array_interface__["data"][0])
        nbytes = view.nbytes
        if any(known.holds(address, nbytes) for known in self.registered):
            return True
        if any(known.start <= address < known.end for known in self.refused):
            return False
        if not self.registered and len(self.refused) >= _PRIVATE_LOOKUPS:
            return False  # not a shared-memory source: stage without looking again
        mapping = mapping_of(address)
        if mapping is None:
            return False
        if not mapping.shared or not mapping.holds(address, nbytes):
            self.refused.append(mapping)
            log.info(
                "%s is private memory or does not hold a whole buffer (%d bytes at %#x); staging "
                "its buffers instead of page-locking them in place",
                _name(mapping),
                nbytes,
                address,
            )
            return False
        return self._register(mapping)

    def _register(self, mapping: MappedRegion) -> bool:
        size = mapping.end - mapping.start
        try:
            code = self._locker.register(mapping.start, size, read_only=not mapping.writable)
            reason = "" if code == 0 else self._locker.describe(code)
        except (AssertionError, RuntimeError) as error:  # torch without CUDA, no driver
            code, reason = -1, str(error).splitlines()[0] if str(error) else type(error).__name__
        if code != 0:
            self.refused.append(mapping)
            log.warning(
                "cudaHostRegister of %s (%d bytes) failed: %s; staging its slots through pinned "
                "host memory instead (one host copy more per micro-batch)",
                _name(mapping),
                size,
                reason,
            )
            return False
        self.registered.append(mapping)
        return True

    def close(self) -> None:
        """Unregister every mapping; call only once no copy out of them is in flight."""
        registered, self.registered = self.registered, []
        for mapping in registered:
            code = self._locker.unregister(mapping.start)
            if code != 0:
                log.warning(
                    "cudaHostUnregister of %s failed: %s",
                    _name(mapping),
                    self._locker.describe(code),
                )


def _consumed(code: int) -> int:
    """Return ``code`` after clearing it from the thread's last CUDA error. A failed runtime call
    stays the thread's last error, and torch's next kernel-launch check (cudaGetLastError) would
    raise it from an unrelated op; torch binds no cudaGetLastError, so a one-element kernel's
    own launch check consumes it."""
    if code != 0:
        with contextlib.suppress(RuntimeError):
            torch.zeros(1, device="cuda")
    return code


def _name(mapping: MappedRegion) -> str:
    return mapping.path or f"anonymous mapping {mapping.start:#x}"
