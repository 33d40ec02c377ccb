"""The backend seam: where atomic units physically live, and how ranges of them are read."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from knitkit.types import SeqRange, UnitKey, UnitRead


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """dtype and shape of a stored unit; axis 0 is the sequence axis that ranges index."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def row_nbytes(self) -> int:
        """Bytes of one sequence position (one row along axis 0)."""
        return np.dtype(self.dtype).itemsize * math.prod(self.shape[1:])

    @property
    def nbytes(self) -> int:
        return self.row_nbytes * (self.shape[0] if self.shape else 1)


UnitNeed = tuple[str, tuple[int, ...], int]
"""What a copy list assumes of a unit it reads (``UnitBytes``, ``ranges.check_need``): its
dtype, its row shape (the dimensions after the first) and the rows it reads up to; rows
``WHOLE``: the unit's whole shape IS that shape (a scalar field, an encoder's multimodal unit)."""
WHOLE = -1


@runtime_checkable
class UnitBackend(Protocol):
    """Stores atomic units by key and reads sequence ranges of them, moving only those bytes.

    Every backend (memory, shared memory, disk shards, Ray, Mooncake) passes the same
    test suite against this contract:
    - ``put`` of an existing key raises ``KeyError`` naming the key; the backend is unchanged.
    - ``replace`` requires the unit to exist with the same dtype and shape (``ValueError`` otherwise).
    - ``read`` of an unknown key raises ``KeyError``; a range outside ``[0, shape[0]]`` raises
      ``IndexError``; both name the key. Ranges are concatenated along axis 0 in the given order.
    - ``bytes_read`` counts the payload bytes moved by ``read`` since construction.
    - ``write_ranges`` overwrites rows of an existing unit (``check_write``'s errors).

    Subclass it to inherit the defaults (``read_many``, ``write_ranges``, ``flush``, ``sync``,
    ``durable``, ``metrics``); a class that only matches the Protocol must define every member
    (``check_backend`` names what is missing when a store is built over it).
    """

    def put(self, key: UnitKey, array: np.ndarray) -> None: ...

    def replace(self, key: UnitKey, array: np.ndarray) -> None: ...

    def spec(self, key: UnitKey) -> UnitSpec: ...

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray: ...

    def read_many(self, reads: Sequence[UnitRead], outs: Sequence[np.ndarray]) -> None:
        """Fill ``outs[i]`` with ``reads[i]`` for every i: the contract (and errors) of ``read``
        with ``out``, one call for a whole micro-batch. This default reads unit by unit; a backend
        that can move many units per call (one Mooncake round trip, one batch of ``preadv``)
        overrides it. ``ValueError`` when the two lengths differ."""
        if len(reads) != len(outs):
            raise ValueError(f"read_many got {len(reads)} reads but {len(outs)} outs; pair them")
        for unit, out in zip(reads, outs, strict=True):
            self.read(unit.key, unit.ranges, out=out)

    def write_ranges(self, key: UnitKey, ranges: Sequence[SeqRange], values: np.ndarray) -> None:
        """Overwrite rows ``ranges`` of an existing unit with ``values`` (their rows back to
        back, the unit's dtype and row shape; see ``ranges.check_write``). This default reads
        the whole unit, pastes the rows and ``replace``s it: all a backend with whole-unit
        replace only can do; a backend that writes in place overrides it."""
        from knitkit.storage.backends.ranges import check_write, paste_ranges

        checked = check_write(key, self.spec(key), ranges, values)
        unit = self.read(key)
        paste_ranges(unit, checked, values)
        self.replace(key, unit)

    def delete(self, key: UnitKey) -> None: ...

    def keys(self) -> Iterator[UnitKey]: ...

    @property
    def bytes_read(self) -> int: ...

    def flush(self) -> None:
        """Make every unit put so far readable by other processes (a buffered backend writes
        its buffer). A job's driver calls it from its scheduler thread while other threads put,
        so a buffered backend serialises it with ``put`` (NOTE [ Owner threads ] in disk.py).
        This default has nothing to do."""
        return None

    def sync(self) -> None:
        """On a durable backend, make every unit flushed so far survive a crash of the machine
        (fsync): ``TrajectoryStore.state_dict`` calls it before it returns a state naming them.
        May run outside the lock of the thread that writes. This default has nothing to do."""
        return None

    @property
    def durable(self) -> bool:
        """Whether units outlive every process that uses the backend, so a store rebuilt over it
        after a crash reads them (``TrajectoryStore.load_state_dict``). Default: no."""
        return False

    def metrics(self) -> dict[str, float]:
        """Backend figures for ``TrajectoryStore.metrics`` (``knitkit/storage/...`` keys, plain
        floats). Default: none."""
        return {}

    def close(self) -> None: ...


PROTOCOL_MEMBERS = (
    "put",
    "replace",
    "spec",
    "read",
    "read_many",
    "write_ranges",
    "delete",
    "keys",
    "bytes_read",
    "flush",
    "sync",
    "durable",
    "metrics",
    "close",
)
"""Every member of ``UnitBackend`` (what ``check_backend`` looks for)."""


class UnitViews(Protocol):
    """Units a copy list reads, resolved ahead (``UnitBytes.map_units``), handed out a range at a
    time as they are when asked."""

    def views(self, start: int, stop: int, nbytes: int) -> list[memoryview]:
        """Flat byte views of units ``start .. stop - 1`` as a read of them would find them
        NOW: a unit deleted since it was mapped raises ``read``'s ``KeyError`` (never another
        unit's bytes from its reused extent), one that does not meet its need ``check_need``'s
        error, one on a segment that shrank ``UnitsLostError``; ``nbytes`` (the bytes the
        caller copies out of them) is added to ``bytes_read``."""
        ...


@runtime_checkable
class UnitBytes(Protocol):
    """A backend whose units are bytes this process has mapped (shared memory, memory): a copy
    list reads them in place (NOTE [ Copy lists ] in delivery/reorganizer.py)."""

    def map_units(self, keys: Sequence[UnitKey], needs: Sequence[UnitNeed]) -> UnitViews:
        """Units ``keys`` (each to meet its need, ``ranges.check_need``) for copy lists that
        read them a range at a time: resolved here where the backend can (one lookup per unit
        for a whole assignment), re-checked per range by ``views``. Raises nothing for a
        unit that is missing or unfit now: ``views`` of its range raises, as a read would."""
        ...


def check_backend(backend: object) -> None:
    """Refuse, naming the missing members, an object that does not implement all of
    ``UnitBackend`` (a wrapper that matches the Protocol without subclassing it lacks the
    defaults, and would otherwise fail deep inside a reorganizer)."""
    missing = [name for name in PROTOCOL_MEMBERS if not hasattr(backend, name)]
    if missing:
        raise TypeError(
            f"{type(backend).__name__} does not implement the UnitBackend Protocol: it has no "
            f"{missing}; subclass knitkit.storage.backends.UnitBackend to inherit the defaults "
            "of read_many, write_ranges, flush, sync, durable and metrics, or define them"
        )
