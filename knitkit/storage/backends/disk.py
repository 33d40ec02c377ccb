"""Disk backend: units in safetensors shards, range reads with ``os.preadv`` straight into the destination."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import struct
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from knitkit.storage.backends.backend import UnitSpec
from knitkit.storage.backends.ranges import check_ranges, check_replacement, destination
from knitkit.types import SeqRange, UnitKey

_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16"}
_DTYPES |= {"F16": "float16", "U32": "uint32", "I32": "int32", "F32": "float32"}
_DTYPES |= {"U64": "uint64", "I64": "int64", "F64": "float64"}


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """Where one unit lies in a shard file: absolute byte offset of its first row, and its spec."""

    shard: str
    offset: int
    spec: UnitSpec


def read_header(path: str) -> dict[UnitKey, ShardEntry]:
    """Parse a safetensors header once (8-byte length, JSON; offsets relative to the data start)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        spec = UnitSpec(_DTYPES[info["dtype"]], tuple(info["shape"]))
        entries[UnitKey.parse(name)] = ShardEntry(path, base + info["data_offsets"][0], spec)
    return entries


class SafetensorsBackend:
    """``UnitBackend`` over safetensors shard files in one directory.

    ``put`` buffers units in memory until ``shard_bytes`` accumulate (or ``flush``), then writes one
    shard; reads and specs of buffered units flush first. ``replace`` rewrites the unit's bytes in
    place (same dtype and shape, so same size). A shard file is removed once all its units are
    deleted. Pickling hands another process a reader of the same files; a reader indexes shards
    flushed after it was made when it meets a key it does not know.
    """

    def __init__(self, directory: str, shard_bytes: int = 256 << 20) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.shard_bytes = shard_bytes
        self._entries: dict[UnitKey, ShardEntry] = {}
        self._pending: dict[UnitKey, np.ndarray] = {}
        self._fds: dict[str, int] = {}
        self._writable: set[str] = set()
        self._bytes_read = 0

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        if key in self._entries or key in self._pending:
            raise KeyError(f"unit {key} already exists; use replace() to update it")
        self._pending[key] = np.array(array, order="C", copy=True)
        if sum(a.nbytes for a in self._pending.values()) >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write buffered units as one new shard."""
        if not self._pending:
            return
        path = os.path.join(self.directory, f"shard-{uuid.uuid4().hex[:12]}.safetensors")
        save_file({str(k): v for k, v in self._pending.items()}, path)
        self._entries.update(read_header(path))
        self._pending.clear()

    def replace(self, key: UnitKey, array: np.ndarray) -> None:
        entry = self._entry(key)
        check_replacement(key, entry.spec, array)
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        written = os.pwritev(self._fd(entry.shard, write=True), [data.data], entry.offset)
        if written != data.nbytes:
            raise OSError(f"short write replacing unit {key} in {entry.shard}")

    def spec(self, key: UnitKey) -> UnitSpec:
        return self._entry(key).spec

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        entry = self._entry(key)
        checked = check_ranges(key, entry.spec, ranges)
        dst = destination(key, entry.spec, checked, out)
        row_nbytes = entry.spec.row_nbytes
        flat = dst.reshape(-1).view(np.uint8)
        fd = self._fd(entry.shard)
        spans = (
            [(0, dst.nbytes)]
            if checked is None
            else [(a * row_nbytes, b * row_nbytes) for a, b in checked]
        )
        pos = 0
        for begin, end in spans:
            _pread_exact(fd, flat[pos : pos + end - begin], entry.offset + begin, key)
            pos += end - begin
        self._bytes_read += dst.nbytes
        return dst

    def delete(self, key: UnitKey) -> None:
        if self._pending.pop(key, None) is not None:
            return
        shard = self._entry(key).shard
        del self._entries[key]
        if all(e.shard != shard for e in self._entries.values()):
            fd = self._fds.pop(shard, None)
            self._writable.discard(shard)
            if fd is not None:
                os.close(fd)
            os.unlink(shard)

    def keys(self) -> Iterator[UnitKey]:
        return iter([*self._entries, *self._pending])

    @property
    def bytes_read(self) -> int:
        return self._bytes_read

    def close(self) -> None:
        self.flush()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._writable.clear()

    def __getstate__(self) -> dict[str, Any]:
        self.flush()
        return {
            "directory": self.directory,
            "shard_bytes": self.shard_bytes,
            "entries": dict(self._entries),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.directory = state["directory"]
        self.shard_bytes = state["shard_bytes"]
        self._entries = state["entries"]
        self._pending = {}
        self._fds = {}
        self._writable = set()
        self._bytes_read = 0

    def _entry(self, key: UnitKey) -> ShardEntry:
        if key in self._pending:
            self.flush()
        if key not in self._entries:
            self._scan_new_shards()
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(
                f"unknown unit {key}; it was never put, was already released, or sits unflushed "
                "in another process's backend (call flush() there before sending the plan)"
            ) from None

    def _scan_new_shards(self) -> None:
        """Index shards written since this instance last looked (another process's flushes)."""
        known = {entry.shard for entry in self._entries.values()}
        for path in glob.glob(os.path.join(self.directory, "*.safetensors")):
            if path not in known:
                with contextlib.suppress(FileNotFoundError):
                    self._entries.update(read_header(path))

    def _fd(self, shard: str, write: bool = False) -> int:
        # NOTE: one fd per shard, reopened read-write once on the first replace; preadv and
        # pwritev take explicit offsets, so threads may share it without a seek lock.
        fd = self._fds.get(shard)
        if fd is None or (write and shard not in self._writable):
            if fd is not None:
                os.close(fd)
            fd = os.open(shard, os.O_RDWR if write else os.O_RDONLY)
            self._fds[shard] = fd
            if write:
                self._writable.add(shard)
        return fd


def _pread_exact(fd: int, dst: np.ndarray, offset: int, key: UnitKey) -> None:
    view = dst.data
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(f"unexpected end of shard reading unit {key} at byte {offset}")
        view, offset = view[n:], offset + n
