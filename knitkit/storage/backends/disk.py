"""Disk backend: units in safetensors shards, range reads with ``os.preadv`` straight into the destination."""

from __future__ import annotations

import contextlib
import glob
import os
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from knitkit.storage.backends.backend import UnitBackend, UnitSpec
from knitkit.storage.backends.ranges import (
    ReadCounter,
    check_replacement,
    check_write,
    paste_ranges,
    spec_of,
)
from knitkit.storage.backends.shard_files import OpenShards
from knitkit.storage.backends.shard_header import CorruptShardError, ShardEntry, read_header
from knitkit.storage.backends.validate import check_unit
from knitkit.types import SeqRange, UnitKey, UnitRead


class SafetensorsBackend(UnitBackend):
    """``UnitBackend`` over safetensors shard files in one directory (created owner-only, 0700).

    ``put`` buffers units in memory until ``shard_bytes`` accumulate (or ``flush``), then writes one
    shard (0600, under a temporary name renamed into place, so a reader never sees half a shard);
    reads and specs of buffered units flush first. ``replace`` rewrites the unit's bytes in
    place (same dtype and shape, so same size). A shard file is removed once all its units are
    deleted. At most ``max_open_shards`` files are open at once (NOTE [ Open shards ]). Pickling
    hands another process a reader of the same files; a reader indexes shards flushed after it
    was made when it meets a key it does not know. A corrupt or truncated shard fails only the
    units it holds, with errors naming the file (``shard_header.py``).

    Durable: a backend made over a directory that already holds shards (a run resumed after a
    crash) indexes them at once, so a store rebuilt over it reads every unit flushed before
    (``TrajectoryStore.load_state_dict``); units still buffered when the process died are lost.
    """

    def __init__(
        self, directory: str, shard_bytes: int = 256 << 20, *, max_open_shards: int = 64
    ) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        self.directory = directory
        self.shard_bytes = shard_bytes
        self._entries: dict[UnitKey, ShardEntry] = {}
        self._pending: dict[UnitKey, np.ndarray] = {}
        self._files = OpenShards(max_open_shards)
        self._reads = ReadCounter()
        self._bad_units: dict[UnitKey, str] = {}
        """Units listed by a shard whose entry for them is invalid: the reason, naming the file."""
        self._corrupt: dict[str, str] = {}
        """Shards whose header cannot be read at all: the reason."""
        self._scan_new_shards()

    @property
    def durable(self) -> bool:
        return True

    @property
    def open_files(self) -> int:
        """Shard files open now (bounded by ``max_open_shards``)."""
        return len(self._files)

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        value = check_unit(key, array)
        if key in self._entries or key in self._pending:
            raise KeyError(f"unit {key} already exists; use replace() to update it")
        self._pending[key] = np.array(value, order="C", copy=True)
        if sum(a.nbytes for a in self._pending.values()) >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write buffered units as one new shard; on failure nothing is left on disk."""
        if not self._pending:
            return
        name = f"shard-{uuid.uuid4().hex[:12]}.safetensors"
        path = os.path.join(self.directory, name)
        partial = os.path.join(self.directory, f".{name}.partial")
        try:
            save_file({str(k): v for k, v in self._pending.items()}, partial)
            os.chmod(partial, 0o600)
            os.rename(partial, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            raise
        entries, bad = read_header(path)
        if bad:
            raise CorruptShardError(f"shard {path} was written with invalid entries: {bad}")
        self._entries.update(entries)
        self._pending.clear()

    def replace(self, key: UnitKey, array: np.ndarray) -> None:
        entry = self._entry(key)
        check_replacement(key, entry.spec, array)
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        with self._files.use(entry.shard, write=True) as fd:
            written = os.pwritev(fd, [data.data], entry.offset)
        if written != data.nbytes:
            raise OSError(f"short write replacing unit {key} in {entry.shard}")

    def write_ranges(self, key: UnitKey, ranges: Sequence[SeqRange], values: np.ndarray) -> None:
        """Write the rows in place: into the buffer if the unit is not flushed yet, else one
        ``pwritev`` per range at its offset in the shard (readers of the file see them)."""
        pending = self._pending.get(key)
        if pending is not None:
            paste_ranges(pending, check_write(key, spec_of(pending), ranges, values), values)
            return
        entry = self._entry(key)
        checked = check_write(key, entry.spec, ranges, values)
        flat = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
        row, at = entry.spec.row_nbytes, 0
        with self._files.use(entry.shard, write=True) as fd:
            for start, stop in checked:
                size = (stop - start) * row
                piece = flat[at : at + size].data
                if size and os.pwritev(fd, [piece], entry.offset + start * row) != size:
                    raise OSError(
                        f"short write of rows [{start}, {stop}) of {key} in {entry.shard}"
                    )
                at += size

    def spec(self, key: UnitKey) -> UnitSpec:
        return self._entry(key).spec

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        entry = self._entry(key)

        def fill(checked: tuple[SeqRange, ...] | None, dst: np.ndarray) -> None:
            with self._files.use(entry.shard) as fd:
                _read_runs(fd, entry.shard, [(key, *p) for p in _pieces(entry, checked, dst)])

        return self._reads.read(key, entry.spec, ranges, out, fill)

    def read_many(self, reads: Sequence[UnitRead], outs: Sequence[np.ndarray]) -> None:
        """``read`` for every pair, opening each shard once per call and reading every run of
        file-contiguous pieces with one ``preadv`` (see NOTE [ Batched disk reads ])."""
        if len(reads) != len(outs):
            raise ValueError(f"read_many got {len(reads)} reads but {len(outs)} outs; pair them")
        by_shard: dict[str, list[_Piece]] = {}
        moved = 0
        for unit, out in zip(reads, outs, strict=True):
            entry = self._entry(unit.key)
            checked, dst = self._reads.open(unit.key, entry.spec, unit.ranges, out)
            pieces = by_shard.setdefault(entry.shard, [])
            pieces.extend((unit.key, *p) for p in _pieces(entry, checked, dst))
            moved += dst.nbytes
        for shard, pieces in by_shard.items():
            with self._files.use(shard) as fd:
                _read_runs(fd, shard, pieces)
        self._reads.bytes += moved

    def delete(self, key: UnitKey) -> None:
        if self._pending.pop(key, None) is not None:
            return
        shard = self._entry(key).shard
        del self._entries[key]
        if all(e.shard != shard for e in self._entries.values()):
            self._files.discard(shard)
            os.unlink(shard)

    def keys(self) -> Iterator[UnitKey]:
        return iter([*self._entries, *self._pending])

    @property
    def bytes_read(self) -> int:
        return self._reads.bytes

    def close(self) -> None:
        self.flush()
        self._files.close()

    def __getstate__(self) -> dict[str, Any]:
        self.flush()
        return {
            "directory": self.directory,
            "shard_bytes": self.shard_bytes,
            "max_open_shards": self._files.capacity,
            "entries": dict(self._entries),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.directory = state["directory"]
        self.shard_bytes = state["shard_bytes"]
        self._entries = state["entries"]
        self._pending = {}
        self._files = OpenShards(state["max_open_shards"])
        self._reads = ReadCounter()
        self._bad_units = {}
        self._corrupt = {}

    def _entry(self, key: UnitKey) -> ShardEntry:
        if key in self._pending:
            self.flush()
        if key not in self._entries and key not in self._bad_units:
            self._scan_new_shards()
        if key in self._bad_units:
            raise CorruptShardError(f"unit {key} cannot be read: {self._bad_units[key]}")
        try:
            return self._entries[key]
        except KeyError:
            corrupt = "".join(
                f"; corrupt shard {p} ({why}) may have held it" for p, why in self._corrupt.items()
            )
            raise KeyError(
                f"unknown unit {key}; it was never put, was already released, or sits unflushed "
                f"in another process's backend (call flush() there before sending the plan){corrupt}"
            ) from None

    def _scan_new_shards(self) -> None:
        """Index shards written since this instance last looked (another process's flushes), and
        forget shards deleted since (closing their files, which would otherwise hold their disk
        space and a descriptor each)."""
        known = {entry.shard for entry in self._entries.values()}
        present = set(glob.glob(os.path.join(self.directory, "shard-*.safetensors")))
        gone = known - present
        if gone:
            self._entries = {k: e for k, e in self._entries.items() if e.shard not in gone}
            for path in gone:
                self._files.discard(path)
        for path in present:
            if path in known or path in self._corrupt:
                continue
            try:
                entries, bad = read_header(path)
            except FileNotFoundError:
                continue
            except CorruptShardError as exc:
                self._corrupt[path] = str(exc)
                continue
            self._entries.update(entries)
            self._bad_units.update(bad)


_Piece = tuple[UnitKey, int, memoryview]
"""(unit, absolute file offset, destination bytes) of one contiguous piece of a read."""

_IOV_MAX = 1024
"""Linux's limit on buffers per ``preadv`` call."""


def _pieces(
    entry: ShardEntry, checked: tuple[SeqRange, ...] | None, dst: np.ndarray
) -> list[tuple[int, memoryview]]:
    """The file offsets and destination bytes of one read's ranges (whole unit for ``None``)."""
    flat = dst.reshape(-1).view(np.uint8).data
    if checked is None:
        return [(entry.offset, flat)] if flat.nbytes else []
    row, pos, out = entry.spec.row_nbytes, 0, []
    for start, stop in checked:
        size = (stop - start) * row
        if size:
            out.append((entry.offset + start * row, flat[pos : pos + size]))
            pos += size
    return out


def _read_runs(fd: int, shard: str, pieces: list[_Piece]) -> None:
    """Fill every piece from ``fd``, one ``preadv`` per run of file-contiguous pieces.

    NOTE [ Batched disk reads ]: pieces stay in the caller's order (a micro-batch's reads), and
    consecutive pieces whose file bytes follow each other (whole units stored back to back, the
    two CP chunks of a unit that meet) become one ``preadv`` with several destination buffers:
    one system call per contiguous run of the file, not per range.
    """
    i = 0
    while i < len(pieces):
        key, offset, view = pieces[i]
        views, end = [view], offset + view.nbytes
        i += 1
        while i < len(pieces) and pieces[i][1] == end and len(views) < _IOV_MAX:
            views.append(pieces[i][2])
            end += pieces[i][2].nbytes
            i += 1
        _preadv_exact(fd, views, offset, shard, key)


def _preadv_exact(fd: int, views: list[memoryview], offset: int, shard: str, key: UnitKey) -> None:
    """Fill ``views`` in order from ``offset``, retrying short reads; a truncated file is a
    ``CorruptShardError`` naming the shard and the unit."""
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            raise CorruptShardError(
                f"shard {shard} ends at byte {offset} while reading unit {key}; "
                "the file was truncated"
            )
        offset += n
        while n:
            if n >= views[0].nbytes:
                n -= views[0].nbytes
                views = views[1:]
            else:
                views[0], n = views[0][n:], 0
