"""Node-local shared-memory backend: units live in reused /dev/shm slabs that other processes map."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from knitkit.storage.backends.backend import UnitBackend, UnitNeed, UnitSpec, UnitViews
from knitkit.storage.backends.journal import RESET, Record, UnitJournal
from knitkit.storage.backends.lost import UnitsLostError
from knitkit.storage.backends.owner import OwnerFinalizer
from knitkit.storage.backends.ranges import (
    ReadCounter,
    check_need,
    check_ranges,
    check_replacement,
    check_write,
    copy_read,
    destination,
    meets_need,
    paste_ranges,
    spec_of,
)
from knitkit.storage.backends.segments import OwnerLock, check_segment_name, sweep_dead_segments
from knitkit.storage.backends.slab import SegmentTruncatedError, Slab, unlink_quietly
from knitkit.storage.backends.validate import SUPPORTED_DTYPES, check_unit
from knitkit.types import SeqRange, UnitKey, UnitRead

_Location = tuple[int, int, UnitSpec]
"""(slab index, byte offset, spec) of one unit."""

_COMPACT_MIN_BYTES = 64 << 10
"""Dead journal bytes tolerated while units are live (compaction then costs a full snapshot)."""


class SharedMemoryBackend(UnitBackend):
    """``UnitBackend`` over /dev/shm slabs; pickle it to hand another process a zero-copy reader.

    The creating process owns the slabs (see NOTE [ Slab lifetime ] in ``slab.py``). A pickled copy
    is a read-only reader attached to the same slabs; it also sees units put after it was pickled
    (see NOTE [ Unit journal ] in ``journal.py``); ``view`` there returns arrays over the shared
    pages, no copy. The owner compacts the journal once its dead records outweigh the live ones,
    so it follows what is stored, not how long the backend has run. At start-up the owner
    removes segments left in ``directory`` by owners that died (NOTE [ Segment names ]); its own
    are kept alive by its owner lock (NOTE [ Owner locks ]). A forked child of the owner never
    cleans up and reads as a reader (NOTE [ Owner-only clean-up ]); reading a slab another process
    shrank raises ``UnitsLostError`` naming the units instead of a SIGBUS (NOTE [ Shrunk
    segments ]). ``write_ranges`` writes rows in place: readers see them at once.

    Not durable: the units die with their owner. After a crash its trajectories must be
    re-written from a durable copy or re-issued (``TrajectoryStore.load_state_dict`` names the
    units it cannot find).
    """

    def __init__(
        self, slab_bytes: int = 256 << 20, directory: str = "/dev/shm", *, sweep: bool = True
    ) -> None:
        if slab_bytes < 1:
            raise ValueError(f"slab_bytes={slab_bytes} must be >= 1")
        self.slab_bytes = slab_bytes
        self.directory = directory
        if sweep:
            sweep_dead_segments(directory)
        self._prefix = f"knitkit-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._slabs: list[Slab] = []
        self._paths: list[str] = []
        self._units: dict[UnitKey, _Location] = {}
        self._owner = True
        self._owner_pid = os.getpid()
        self._reads = ReadCounter()
        self._created = 0
        lock = OwnerLock(directory, self._prefix)  # first, so the sweep never sees us unlocked
        try:
            stem = os.path.join(directory, f"{self._prefix}-journal")
            self._journal = UnitJournal(stem, owner=True)
        except BaseException:
            lock.release()
            raise
        self._live_bytes = 0
        """Journal bytes a snapshot of the live state takes (slab and put records)."""
        self._put_bytes: dict[UnitKey, int] = {}
        self._deletes = 0
        """Units this process saw deleted (or forgot) so far (NOTE [ Units mapped ahead ])."""
        self._finalizer = OwnerFinalizer(self, _unlink_all, self._paths, self._journal, lock)

    @property
    def paths(self) -> tuple[str, ...]:
        """The slab files (for tests and leak checks)."""
        return tuple(self._paths)

    @property
    def journal_bytes(self) -> int:
        """Size of the unit journal now (it follows the live units, see ``_maybe_compact``)."""
        return self._journal.size

    def metrics(self) -> dict[str, float]:
        """What this backend holds in its directory (gauges):

        - ``knitkit/storage/shm_bytes``: bytes of /dev/shm it occupies (slabs and journal);
        - ``knitkit/storage/shm_used_bytes``: of the slabs, bytes allocated to live units;
        - ``knitkit/storage/journal_bytes``: the unit journal's size.
        """
        journal = float(self._journal.size) if self._journal.open else 0.0
        return {
            "knitkit/storage/shm_bytes": float(sum(s.size for s in self._slabs)) + journal,
            "knitkit/storage/shm_used_bytes": float(self.used_bytes),
            "knitkit/storage/journal_bytes": journal,
        }

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        self._require_owner("put")
        value = check_unit(key, array)
        if key in self._units:
            raise KeyError(f"unit {key} already exists; use replace() to update it")
        spec = spec_of(value)
        slab_index, offset = self._alloc(spec.nbytes)
        try:
            self._slabs[slab_index].check_size()  # NOTE [ Shrunk segments ] in slab.py
        except SegmentTruncatedError:
            self._slabs[slab_index].free(offset)
            raise
        np.copyto(self._slabs[slab_index].array(offset, spec.dtype, spec.shape), value)
        self._slabs[slab_index].holds(offset + spec.nbytes)
        self._units[key] = (slab_index, offset, spec)
        size = self._journal.append(_put_record(key, (slab_index, offset, spec)))
        self._put_bytes[key] = size
        self._live_bytes += size

    def replace(self, key: UnitKey, array: np.ndarray) -> None:
        self._require_owner("replace")
        check_replacement(key, self.spec(key), array)
        np.copyto(self._view(key), array)

    def write_ranges(self, key: UnitKey, ranges: Sequence[SeqRange], values: np.ndarray) -> None:
        """Write the rows in place, in the shared pages: readers see them at once."""
        self._require_owner("write_ranges")
        checked = check_write(key, self.spec(key), ranges, values)
        paste_ranges(self._view(key), checked, values)

    def spec(self, key: UnitKey) -> UnitSpec:
        return self._locate(key)[2]

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        return self._reads.copy_rows(key, self._view(key), ranges, out)

    def read_many(self, reads: Sequence[UnitRead], outs: Sequence[np.ndarray]) -> None:
        """``read`` for every pair in one call: a reader's journal followed once, each slab's
        size checked once, and per unit one lookup, the contract's checks and one byte copy per
        range (see NOTE [ Batched shared-memory reads ])."""
        if len(reads) != len(outs):
            raise ValueError(f"read_many got {len(reads)} reads but {len(outs)} outs; pair them")
        self._sync()
        slabs, units, moved = self._slabs, self._units, 0
        sized: set[int] = set()
        try:
            for unit, out in zip(reads, outs, strict=True):
                slab_index, offset, spec = units.get(unit.key) or self._lookup(unit.key)
                if slab_index not in sized:  # once per slab and call
                    self._check_slab(slab_index, (r.key for r in reads))
                    sized.add(slab_index)
                if unit.columns is None:
                    moved += _copy_unit(unit, spec, slabs[slab_index].bytes, offset, out)
                else:  # a column range: a strided copy of a typed view
                    stored = slabs[slab_index].array(offset, spec.dtype, spec.shape)
                    moved += copy_read(unit, spec, stored, out).nbytes
        finally:
            self._reads.bytes += moved

    def map_units(self, keys: Sequence[UnitKey], needs: Sequence[UnitNeed]) -> UnitViews:
        """Every unit of ``keys`` resolved now, in one loop (NOTE [ Units mapped ahead ])."""
        return _MappedUnits(self, keys, needs)

    def _sync(self) -> None:
        """This process's view of the store brought up to date: ``_follow``, then new pages
        mapped."""
        self._follow()
        self._populate()

    def _follow(self) -> None:
        """This process's index brought up to date: a forked owner becomes a reader, a reader
        follows the journal."""
        if self._owner:  # a reader cannot be a fork of the owner: no call for it
            self._check_fork()
        if not self._owner:
            self._follow_journal()

    def _unit_bytes(
        self, keys: Sequence[UnitKey], needs: Sequence[UnitNeed]
    ) -> tuple[list[memoryview], list[_Location]]:
        """Flat byte views of whole units over the shared pages and their locations, with
        ``read_many``'s slab checks and errors, each unit checked against its need
        (``check_need``); the caller ``_sync``ed first."""
        units, out, located = self._units, [], []
        checked: set[int] = set()
        for key, need in zip(keys, needs, strict=True):
            location = units.get(key) or self._lookup(key)
            slab_index, offset, spec = location
            if slab_index not in checked:  # once per slab and call
                self._check_slab(slab_index, keys)
                checked.add(slab_index)
            check_need(key, spec, need)
            size = _unit_nbytes(spec)
            out.append(self._slabs[slab_index].bytes.data[offset : offset + size])
            located.append(location)
        return out, located

    def view(self, key: UnitKey) -> np.ndarray:
        """Zero-copy view of a whole unit over the shared pages (read-only in readers)."""
        return self._view(key)

    def delete(self, key: UnitKey) -> None:
        self._require_owner("delete")
        slab_index, offset, _ = self._locate(key)
        self._slabs[slab_index].free(offset)
        del self._units[key]
        self._deletes += 1
        self._live_bytes -= self._put_bytes.pop(key)
        self._journal.append(("delete", str(key)))
        self._maybe_compact()

    def keys(self) -> Iterator[UnitKey]:
        self._follow()
        return iter(list(self._units))

    @property
    def bytes_read(self) -> int:
        return self._reads.bytes

    @property
    def used_bytes(self) -> int:
        return sum(s.used_bytes for s in self._slabs)

    def close(self) -> None:
        for slab in self._slabs:
            slab.close()
        self._slabs.clear()
        self._units.clear()
        if self._owner:
            self._finalizer()  # a no-op in a forked child: NOTE [ Owner-only clean-up ]
        self._journal.close()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "paths": list(self._paths),
            "sizes": [s.size for s in self._slabs],
            "units": dict(self._units),
            "journal": self._journal.stem,
            "generation": self._journal.generation,
            "journal_offset": self._journal.size,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._paths = list(state["paths"])
        self._slabs = [
            Slab(p, n, owner=False) for p, n in zip(self._paths, state["sizes"], strict=True)
        ]
        self._units = state["units"]
        for slab_index, offset, spec in self._units.values():
            self._slabs[slab_index].holds(offset + spec.nbytes)
        self._journal = UnitJournal(
            state["journal"],
            owner=False,
            generation=state["generation"],
            offset=state["journal_offset"],
        )
        self._owner = False
        self._owner_pid = 0
        self._reads = ReadCounter()
        self._deletes = 0
        self.slab_bytes = 0
        self.directory = os.path.dirname(state["journal"])
        self._prefix = os.path.basename(state["journal"]).removesuffix("-journal")

    def _alloc(self, nbytes: int) -> tuple[int, int]:
        for index, slab in enumerate(self._slabs):
            offset = slab.alloc(nbytes)
            if offset is not None:
                return index, offset
        # A fresh name per attempt, so a failed creation never blocks the next
        # (NOTE [ Segment names ]).
        path = os.path.join(self.directory, f"{self._prefix}-slab{self._created}")
        self._created += 1
        slab = Slab(path, max(self.slab_bytes, nbytes + 64), owner=True)
        self._paths.append(path)
        self._slabs.append(slab)
        self._live_bytes += self._journal.append(_slab_record(slab))
        offset = slab.alloc(nbytes)
        assert offset is not None
        return len(self._slabs) - 1, offset

    def _maybe_compact(self) -> None:
        """Rewrite the journal as a snapshot once dead records outweigh live ones (64 KiB at least)."""
        # Once nothing is live a snapshot is just the slab records: compact right away, so an
        # idle store's journal has the same size after every cycle of a run.
        dead = self._journal.size - self._live_bytes
        if dead <= (max(self._live_bytes, _COMPACT_MIN_BYTES) if self._units else 0):
            return
        self._journal.rewrite(
            [
                *(_slab_record(s) for s in self._slabs),
                *(_put_record(k, loc) for k, loc in self._units.items()),
            ]
        )
        self._live_bytes = self._journal.size

    def _locate(self, key: UnitKey) -> _Location:
        self._follow()
        return self._lookup(key)

    def _check_fork(self) -> None:
        """In a forked child of the owner, become a reader of the parent's store: the child's
        copy of the owner's state goes stale at once, and writing through it would corrupt the
        parent's slabs and journal (see NOTE [ Owner-only clean-up ] in ``owner.py``)."""
        if not self._owner or os.getpid() == self._owner_pid:
            return
        stem, generation = self._journal.stem, self._journal.generation
        self._journal.close()  # the child's copy of the owner's append descriptor
        self._owner, self._owner_pid = False, 0
        self._units.clear()
        self._deletes += 1
        self._put_bytes.clear()
        self._journal = UnitJournal(stem, owner=False, generation=generation, offset=0)

    def _lookup(self, key: UnitKey) -> _Location:
        """The unit's location as this process knows it now (``_locate`` follows the journal)."""
        try:
            return self._units[key]
        except KeyError:
            raise KeyError(
                f"unknown unit {key}; it was never put or was already released"
            ) from None

    def _follow_journal(self) -> None:
        """Apply the owner's slabs, puts and deletes recorded since this reader last looked."""
        slab_index = len(self._slabs)
        for record in self._journal.new_records():
            op = record[0]
            if op == RESET:
                self._units.clear()
                self._deletes += 1
                slab_index = 0
            elif op == "slab":
                self._attach_slab(record, slab_index)
                slab_index += 1
            elif op == "put":
                key, location = self._check_put(record)
                self._units[key] = location
                self._slabs[location[0]].holds(location[1] + location[2].nbytes)
            elif op == "delete":
                self._units.pop(UnitKey.parse(str(record[1])), None)
                self._deletes += 1
            else:
                raise ValueError(f"journal {self._journal.path}: unknown record {record!r}")

    def _attach_slab(self, record: Record, index: int) -> None:
        """Map the ``index``-th slab named by the journal (a snapshot re-lists known slabs)."""
        name, size = str(record[1]), _int(record[2])
        try:
            check_segment_name(name)
        except ValueError as exc:
            raise ValueError(f"journal {self._journal.path}: {exc}") from None
        if not name.startswith(f"{self._prefix}-"):
            raise ValueError(f"journal {self._journal.path} names foreign segment {name!r}")
        path = os.path.join(self.directory, name)
        if index < len(self._paths):
            if self._paths[index] != path:
                raise ValueError(f"journal {self._journal.path}: slab {index} is {path}")
            return
        self._slabs.append(Slab(path, size, owner=False))
        self._paths.append(path)

    def _check_put(self, record: Record) -> tuple[UnitKey, _Location]:
        """A put record's location must lie inside a known slab (never trust offsets blindly)."""
        try:
            _, raw_key, raw_slab, raw_offset, dtype, shape = record
            key = UnitKey.parse(str(raw_key))
            if not isinstance(shape, list):
                raise TypeError("shape is not a list")
            spec = UnitSpec(str(dtype), tuple(_int(n) for n in shape))
            slab, offset = _int(raw_slab), _int(raw_offset)
            ok = (
                spec.dtype in SUPPORTED_DTYPES
                and all(n >= 0 for n in spec.shape)
                and 0 <= slab < len(self._slabs)
                and offset >= 0
                and offset + spec.nbytes <= self._slabs[slab].size
            )
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"journal {self._journal.path}: invalid put record {record!r}")
        return key, (slab, offset, spec)

    def _view(self, key: UnitKey) -> np.ndarray:
        slab_index, offset, spec = self._locate(key)
        self._populate()
        self._check_slab(slab_index, (key,))
        return self._slabs[slab_index].array(offset, spec.dtype, spec.shape)

    def _populate(self) -> None:
        """Map the pages of every slab up to its high-water mark where some are not yet (NOTE
        [ Populated mappings ] in slab.py): one compare per slab unless a mark moved. A shrunk
        slab is skipped here; a read of it raises (``_check_slab``)."""
        for slab in self._slabs:
            with contextlib.suppress(SegmentTruncatedError):
                slab.populate()

    def _check_slab(self, index: int, keys: Iterable[UnitKey]) -> None:
        """Before reads of ``keys`` touch slab ``index``: if another process shrank it, every
        unit it holds is lost; raise ``UnitsLostError`` naming the ones of ``keys`` it held (a
        bounded list; the message names the segment) instead of dying of SIGBUS (see
        NOTE [ Shrunk segments ] in ``slab.py``). ``keys`` is only iterated then."""
        try:
            self._slabs[index].check_size()
        except SegmentTruncatedError as exc:
            asked = dict.fromkeys(keys)
            lost = [k for k in asked if (loc := self._units.get(k)) and loc[0] == index]
            raise UnitsLostError(lost, self._slabs[index].path, str(exc)) from None

    def _require_owner(self, op: str) -> None:
        self._check_fork()
        if not self._owner:
            raise RuntimeError(
                f"{op}() on an attached shared-memory reader (a pickled copy, or a forked "
                "child's copy of the owner); write through the owner"
            )


# NOTE [ Units mapped ahead ]: a reorganizer compiles a whole assignment into copy lists, then
# publishes its micro-batches one slot at a time (NOTE [ Copy lists ] in
# delivery/reorganizer.py). ``map_units`` resolves every unit of the assignment in ONE loop
# (a key's lookup, its need, its view), right after the compile, while that code is hot;
# ``views`` per micro-batch only brings the reader up to date (the journal followed: one fstat)
# and checks each slab it reads (one fstat), so no Python runs per unit after a slot wait,
# when the process's caches are cold (the same lookups cost 3-5x there: transfer.py, load ~10,
# 39-78 us per micro-batch in the process against 10 us in a hot loop). Nothing a read
# guarantees is lost: a unit deleted since it was mapped (its extent perhaps reused by another)
# is found by its location no longer being the one the reader's index holds, checked for the
# range's units only when this process saw a delete since the map (``_deletes``: the owner's
# deletes, the journal's delete and reset records, a fork), and then read as ``read_many``
# would, raising its ``KeyError``; a unit missing or unfit at map time raises when its range
# is asked for, so the micro-batches before it still arrive.
class _MappedUnits:
    """``UnitViews`` of a ``SharedMemoryBackend`` (NOTE [ Units mapped ahead ])."""

    __slots__ = ("_backend", "_deletes", "_keys", "_located", "_needs", "_views")

    def __init__(
        self, backend: SharedMemoryBackend, keys: Sequence[UnitKey], needs: Sequence[UnitNeed]
    ) -> None:
        backend._sync()
        self._backend, self._keys, self._needs = backend, keys, needs
        self._deletes = backend._deletes
        units, slabs = backend._units, backend._slabs
        mapped: dict[int, memoryview] = {}  # each slab's bytes, once per assignment
        views: list[memoryview | None] = []
        located: list[_Location | None] = []
        for key, need in zip(keys, needs, strict=True):
            location = units.get(key)
            if location is not None:
                slab_index, offset, spec = location
                if meets_need(spec, need):
                    size = _unit_nbytes(spec)
                    slab = mapped.get(slab_index)
                    if slab is None:
                        slab = mapped[slab_index] = slabs[slab_index].bytes.data
                    views.append(slab[offset : offset + size])
                    located.append(location)
                    continue
            views.append(None)  # missing or unfit: its range reads it strictly, and raises
            located.append(None)
        self._views, self._located = views, located

    def views(self, start: int, stop: int, nbytes: int) -> list[memoryview]:
        backend = self._backend
        backend._follow()
        located = self._located[start:stop]
        views: list[memoryview]
        if None in located or (
            backend._deletes != self._deletes
            and any(
                backend._units.get(k) is not at
                for k, at in zip(self._keys[start:stop], located, strict=True)
            )
        ):
            backend._populate()
            views, now = backend._unit_bytes(self._keys[start:stop], self._needs[start:stop])
            self._views[start:stop], self._located[start:stop] = views, now
        else:  # no None in either: typed by the check above
            views = self._views[start:stop]  # type: ignore[assignment]
            found: list[_Location] = located  # type: ignore[assignment]
            slab_index = -1
            for at in found:
                if at[0] != slab_index:  # once per slab and range, as ``read_many``
                    slab_index = at[0]
                    backend._check_slab(slab_index, self._keys[start:stop])
        backend._reads.bytes += nbytes
        return views


# NOTE [ Batched shared-memory reads ]: a reorganizer reads ~8 units per micro-batch, each a
# few ranges, straight into its ring slot. Per unit, ``read_many`` pays one dict lookup, the
# contract's range check (``check_ranges``), a destination check of four attribute compares
# (the full ``destination`` check only runs to word the error when one fails) and, per range,
# one slice assignment between flat byte views of the slab and the destination: numpy moves
# it with one memcpy. No typed view of the stored unit is built (``Slab.array``: a reshape per
# unit) and a unit's row size comes from a small cache keyed by dtype and row shape.
# On transfer.py's workload (2.4 MiB micro-batches, 7.7 unit reads each; thread CPU, medians
# of 25 alternating passes in one process, load ~10): 160 us per micro-batch with a typed view
# and ``copy_read`` per unit, 151 us this way, against 145 us for the bare slice copies alone;
# the Python per unit went from ~2 to ~1 us, the rest is the memcpy. Column reads (a stage's
# layers) keep the typed strided copy.
def _copy_unit(
    unit: UnitRead, spec: UnitSpec, slab: np.ndarray, offset: int, out: np.ndarray
) -> int:
    """Copy ``unit`` (its ranges, checked) out of a slab's bytes ``slab`` at ``offset`` into
    ``out``; returns the bytes moved. The contract's errors name the key."""
    dtype, row = _row_layout(spec)
    ranges = check_ranges(unit.key, spec, unit.ranges)
    if ranges is None:
        rows, want = (spec.shape[0] if spec.shape else 1), spec.shape
    else:
        rows = sum(stop - start for start, stop in ranges)
        want = (rows, *spec.shape[1:])
    if out.dtype != dtype or out.shape != want or not out.flags.c_contiguous:
        destination(unit.key, spec, ranges, out)  # raises the contract's error
    dst = out.reshape(-1).view(np.uint8)
    if ranges is None:
        dst[:] = slab[offset : offset + rows * row]
        return rows * row
    at = 0
    for start, stop in ranges:
        size = (stop - start) * row
        begin = offset + start * row
        dst[at : at + size] = slab[begin : begin + size]
        at += size
    return at


def _row_layout(spec: UnitSpec) -> tuple[np.dtype[Any], int]:
    """numpy dtype and bytes per row of units like ``spec`` (cached by dtype and row shape)."""
    key = (spec.dtype, spec.shape[1:])
    layout = _ROW_LAYOUTS.get(key)
    if layout is None:
        layout = _ROW_LAYOUTS[key] = (np.dtype(spec.dtype), spec.row_nbytes)
    return layout


def _unit_nbytes(spec: UnitSpec) -> int:
    """Bytes of a whole unit like ``spec`` (``spec.nbytes`` through the row-layout cache)."""
    return _row_layout(spec)[1] * (spec.shape[0] if spec.shape else 1)


_ROW_LAYOUTS: dict[tuple[str, tuple[int, ...]], tuple[np.dtype[Any], int]] = {}
"""(dtype, row shape) -> (numpy dtype, row bytes); stored units come in a handful of kinds."""


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _slab_record(slab: Slab) -> Record:
    return ("slab", os.path.basename(slab.path), slab.size)


def _put_record(key: UnitKey, location: _Location) -> Record:
    slab, offset, spec = location
    return ("put", str(key), slab, offset, spec.dtype, list(spec.shape))


def _unlink_all(paths: list[str], journal: UnitJournal, lock: OwnerLock) -> None:
    """The owner's clean-up: slabs, journal, and last the lock (NOTE [ Owner locks ])."""
    for path in paths:
        unlink_quietly(path)
    journal.unlink()
    lock.release()
