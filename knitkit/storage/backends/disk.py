"""Disk backend: units in safetensors shards, range reads with ``os.preadv`` straight into the destination."""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from safetensors.numpy import save_file

from knitkit.storage.backends.backend import UnitBackend, UnitSpec
from knitkit.storage.backends.journal import RESET, Record, UnitJournal
from knitkit.storage.backends.owner import OwnerFinalizer
from knitkit.storage.backends.ranges import (
    ReadCounter,
    check_replacement,
    check_write,
    open_read,
    paste_ranges,
    spec_of,
)
from knitkit.storage.backends.segments import OwnerLock, check_segment_name, sweep_dead_segments
from knitkit.storage.backends.shard_files import OpenShards
from knitkit.storage.backends.shard_header import CorruptShardError, ShardEntry, read_header
from knitkit.storage.backends.validate import SUPPORTED_DTYPES, check_unit
from knitkit.types import SeqRange, UnitKey, UnitRead

_COMPACT_MIN_BYTES = 64 << 10
"""Dead journal bytes tolerated while units are live (compaction then costs a full snapshot)."""


_R = TypeVar("_R")

# NOTE [ Owner threads ]:
# A job's driver uses its store's backend from several threads: rollout writes and write-backs
# under the driver's lock, but the scheduler thread flushes without it before it serves a pass
# (knitkit/job/serving.py: file I/O the writers need not wait for). ``flush`` wrote the buffer it
# had seen, then cleared the buffer: a unit ``put`` in between was dropped while the store's
# index kept it, and its readers and its delete later raised ``KeyError: unknown unit``
# (tests/job/test_checkpoint.py, ~1 run in 10 on a loaded machine). Every method that touches
# the index, the buffer or the journal therefore runs under one re-entrant lock of the backend
# (``put`` may flush, ``delete`` may flush through ``_entry``): a put waits for a flush in
# progress, a flush writes every unit put before it took the lock. Reads hold it only for
# their lookups; the bytes are read outside it.


def _serialised(method: Callable[..., _R]) -> Callable[..., _R]:
    """Run ``method`` under its backend's state lock (NOTE [ Owner threads ])."""

    @functools.wraps(method)
    def locked(self: SafetensorsBackend, *args: Any, **kwargs: Any) -> _R:
        with self._state_lock:
            return method(self, *args, **kwargs)

    return locked


class SafetensorsBackend(UnitBackend):
    """``UnitBackend`` over safetensors shard files in one directory (created owner-only, 0700).

    ``put`` buffers units in memory until ``shard_bytes`` accumulate (or ``flush``), then writes one
    shard (0600, under a temporary name renamed into place, so a reader never sees half a shard);
    reads and specs of buffered units flush first. ``replace`` rewrites the unit's bytes in
    place (same dtype and shape, so same size). A shard file is removed once all its units are
    deleted. At most ``max_open_shards`` files are open at once (NOTE [ Open shards ]). A corrupt
    or truncated shard fails only the units it holds, with errors naming the file
    (``shard_header.py``).

    The creating instance owns the directory's units; pickling hands another process a reader
    that follows the owner's later flushes and deletes through a journal in the directory
    (NOTE [ Disk readers follow the owner ]). ``sync`` makes what a saved state names durable
    (NOTE [ Durable shards ]).

    Durable: a backend made over a directory that already holds shards (a run resumed after a
    crash) indexes them at once, so a store rebuilt over it reads every unit flushed before
    (``TrajectoryStore.load_state_dict``); units still buffered when the process died are lost.
    """

    # NOTE [ Disk readers follow the owner ]:
    # A reader (a reorganizer, spawned with a pickled copy) may live longer than any one index
    # the owner had: a resumed driver starts its reorganizers, then ``load_state_dict`` deletes
    # every unit the checkpoint does not name (their shards unlinked once empty) and the job
    # writes the same keys again, into new shards; a trajectory id written again after its
    # deferred delete does the same in a running job. A reader holding the index it was pickled
    # with then read the old shard: ``FileNotFoundError``, or silently the OLD bytes where the
    # shard still held a live unit. Rescanning shard headers cannot fix that (a shard keeps a
    # deleted unit's bytes and header entry until its last unit goes). So the owner's index is
    # the only one: the owner appends a record per flushed unit (shard, offset, spec) and per
    # delete to a journal (NOTE [ Unit journal ]) before a plan naming the unit can be sent (the
    # driver flushes before it serves a pass), and a reader replays it before every lookup (one
    # ``fstat`` when nothing changed): its index is the owner's as of its last look, in the
    # owner's order, so a unit re-written under its key is read at its new place, never from its
    # old bytes. Considered instead: starting reorganizers after the load (fixes resume only, not a
    # re-write in a running job); a version per key in every plan (touches the planner and every
    # host for what the journal already gives the shared-memory backend). The journal and the
    # owner's lock live in the shard directory as ``knitkit-<pid>-<hex>-journal-<n>`` and
    # ``knitkit-<pid>-<hex>-lock`` (NOTE [ Segment names ]): a shared file system that holds the
    # shards holds them too; the owner unlinks them on close, and a new owner removes those of
    # owners that died (SIGKILL), by their lock.

    def __init__(
        self, directory: str, shard_bytes: int = 256 << 20, *, max_open_shards: int = 64
    ) -> None:
        created = not os.path.isdir(directory)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        self.directory = directory
        self.shard_bytes = shard_bytes
        self._entries: dict[UnitKey, ShardEntry] = {}
        self._per_shard: Counter[str] = Counter()
        """Units indexed per shard file (a shard goes, and its descriptor, once none are)."""
        self._pending: dict[UnitKey, np.ndarray] = {}
        self._state_lock = threading.RLock()
        """Serialises the methods that touch the index, the buffer and the journal (NOTE
        [ Owner threads ])."""
        self._files = OpenShards(max_open_shards)
        self._reads = ReadCounter()
        self._bad_units: dict[UnitKey, str] = {}
        """Units listed by a shard whose entry for them is invalid: the reason, naming the file."""
        self._corrupt: dict[str, str] = {}
        """Shards whose header cannot be read at all: the reason."""
        self._unsynced = _Unsynced(directory, parent=created)
        self._owner_pid = os.getpid()
        for path in _shard_paths(directory):
            self._index_shard(path)
        sweep_dead_segments(directory, rings=False)
        group = f"knitkit-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        lock = OwnerLock(directory, group)  # first, so a sweep never sees the journal unlocked
        try:
            self._journal = UnitJournal(os.path.join(directory, f"{group}-journal"), owner=True)
            sizes = self._journal.extend(_put_record(k, e) for k, e in self._entries.items())
        except BaseException:
            lock.release()
            raise
        self._record_bytes = dict(zip(self._entries, sizes, strict=True))
        """Journal bytes of each live unit's put record."""
        self._live_bytes = self._journal.size
        """Journal bytes a snapshot of the live units takes (what compaction keeps)."""
        self._finalizer: OwnerFinalizer | None = OwnerFinalizer(
            self, _remove_journal, self._journal, lock
        )

    @property
    def durable(self) -> bool:
        return True

    @property
    def open_files(self) -> int:
        """Shard files open now (bounded by ``max_open_shards``)."""
        return len(self._files)

    @property
    def journal_bytes(self) -> int:
        """Size of the unit journal now (it follows the live units, see ``_maybe_compact``)."""
        return self._journal.size

    def metrics(self) -> dict[str, float]:
        """``knitkit/storage/journal_bytes``: the unit journal's size (owner; gauge)."""
        if not self._owns() or not self._journal.open:
            return {}
        return {"knitkit/storage/journal_bytes": float(self._journal.size)}

    @_serialised
    def put(self, key: UnitKey, array: np.ndarray) -> None:
        self._require_owner("put")
        value = check_unit(key, array)
        if key in self._entries or key in self._pending:
            raise KeyError(f"unit {key} already exists; use replace() to update it")
        self._pending[key] = np.array(value, order="C", copy=True)
        if sum(a.nbytes for a in self._pending.values()) >= self.shard_bytes:
            self.flush()

    @_serialised
    def flush(self) -> None:
        """Write buffered units as one new shard and journal them; on failure nothing is left on
        disk."""
        if not self._owns() or not self._pending:
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
        self._unsynced.wrote(path, new=True)
        for key, entry in entries.items():
            self._index(key, entry)
        sizes = self._journal.extend(_put_record(k, e) for k, e in entries.items())
        self._record_bytes.update(zip(entries, sizes, strict=True))
        self._live_bytes += sum(sizes)
        self._pending.clear()

    def sync(self) -> None:
        """Fsync every shard written or changed since the last ``sync`` and the directory (see
        NOTE [ Durable shards ]). Safe to call while this backend's owner thread goes on."""
        if self._owns():
            self._unsynced.sync()

    @_serialised
    def replace(self, key: UnitKey, array: np.ndarray) -> None:
        self._require_owner("replace")
        entry = self._entry(key)
        check_replacement(key, entry.spec, array)
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        with self._files.use(entry.shard, write=True) as fd:
            written = os.pwritev(fd, [data.data], entry.offset)
        if written != data.nbytes:
            raise OSError(f"short write replacing unit {key} in {entry.shard}")
        self._unsynced.wrote(entry.shard)

    @_serialised
    def write_ranges(self, key: UnitKey, ranges: Sequence[SeqRange], values: np.ndarray) -> None:
        """Write the rows in place: into the buffer if the unit is not flushed yet, else one
        ``pwritev`` per range at its offset in the shard (readers of the file see them)."""
        self._require_owner("write_ranges")
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
        self._unsynced.wrote(entry.shard)

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
        file-contiguous pieces with one ``preadv``; a read's ``columns`` (a pipeline stage's
        layers) take only that range of each row (see NOTE [ Batched disk reads ])."""
        if len(reads) != len(outs):
            raise ValueError(f"read_many got {len(reads)} reads but {len(outs)} outs; pair them")
        with self._state_lock:  # NOTE [ Owner threads ]
            if any(unit.key in self._pending for unit in reads):
                self.flush()
            self._follow()
            entries = [self._lookup(unit.key) for unit in reads]
        by_shard: dict[str, list[_Piece]] = {}
        staged: dict[str, list[_ColumnSpan]] = {}
        moved = 0
        for unit, out, entry in zip(reads, outs, entries, strict=True):
            checked, columns, dst = open_read(unit, entry.spec, out)
            moved += dst.nbytes
            if dst.nbytes and _staged(entry.spec, columns):
                assert columns is not None
                spans = staged.setdefault(entry.shard, [])
                spans.extend(_column_spans(unit.key, entry, checked, dst, columns))
            elif dst.nbytes:
                pieces = by_shard.setdefault(entry.shard, [])
                pieces.extend((unit.key, *p) for p in _pieces(entry, checked, dst, columns))
        for shard in dict.fromkeys([*by_shard, *staged]):
            with self._files.use(shard) as fd:
                _read_runs(fd, shard, by_shard.get(shard, []))
                _read_staged(fd, shard, staged.get(shard, []))
        self._reads.bytes += moved

    @_serialised
    def delete(self, key: UnitKey) -> None:
        self._require_owner("delete")
        if self._pending.pop(key, None) is not None:
            return
        shard = self._entry(key).shard
        self._journal.append(("delete", str(key)))  # before the unlink: readers forget it first
        self._live_bytes -= self._record_bytes.pop(key)
        if self._unindex(key):
            os.unlink(shard)
            self._unsynced.removed(shard)
        self._maybe_compact()

    @_serialised
    def keys(self) -> Iterator[UnitKey]:
        self._follow()
        return iter([*self._entries, *self._pending])

    @property
    def bytes_read(self) -> int:
        return self._reads.bytes

    def close(self) -> None:
        if self._owns():
            self.flush()
            assert self._finalizer is not None
            self._finalizer()  # unlinks the journal and the lock; a no-op in a forked child
        self._journal.close()
        self._files.close()

    @_serialised
    def __getstate__(self) -> dict[str, Any]:
        self.flush()
        self._follow()
        return {
            "directory": self.directory,
            "shard_bytes": self.shard_bytes,
            "max_open_shards": self._files.capacity,
            "entries": dict(self._entries),
            "bad_units": dict(self._bad_units),
            "journal": self._journal.stem,
            "generation": self._journal.generation,
            "offset": self._journal.size if self._owns() else self._journal.offset,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.directory = state["directory"]
        self.shard_bytes = state["shard_bytes"]
        self._entries = {}
        self._per_shard = Counter()
        for key, entry in state["entries"].items():
            self._index(key, entry)
        self._pending = {}
        self._state_lock = threading.RLock()
        self._files = OpenShards(state["max_open_shards"])
        self._reads = ReadCounter()
        self._bad_units = state["bad_units"]
        self._corrupt = {}
        self._unsynced = _Unsynced(self.directory, parent=False)
        self._owner_pid = 0
        self._journal = UnitJournal(
            state["journal"], owner=False, generation=state["generation"], offset=state["offset"]
        )
        self._record_bytes = {}
        self._live_bytes = 0
        self._finalizer = None

    def _require_owner(self, op: str) -> None:
        """Only the creating process writes: a reader's (or a forked child's) index follows the
        owner's and must not fork from it (NOTE [ Disk readers follow the owner ])."""
        if not self._owns():
            raise RuntimeError(
                f"{op}() on a reader of the disk backend over {self.directory} (a pickled copy, "
                "or a forked child's copy of the owner); write through the owner"
            )

    @_serialised
    def _entry(self, key: UnitKey) -> ShardEntry:
        if key in self._pending:
            self.flush()
        self._follow()
        return self._lookup(key)

    def _lookup(self, key: UnitKey) -> ShardEntry:
        """The unit's location as this instance knows it now (``_entry`` follows first)."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        if key in self._bad_units:
            raise CorruptShardError(f"unit {key} cannot be read: {self._bad_units[key]}")
        corrupt = "".join(
            f"; corrupt shard {p} ({why}) may have held it" for p, why in self._corrupt_shards()
        )
        raise KeyError(
            f"unknown unit {key}; it was never put, was already released, or sits unflushed "
            f"in the owner's backend (call flush() there before sending the plan){corrupt}"
        ) from None

    def _follow(self) -> None:
        """A reader: apply the owner's flushes and deletes journaled since it last looked."""
        if self._owns():
            return
        dropped: set[str] = set()
        for record in self._journal.new_records():
            op = record[0]
            if op == RESET:  # a compacted generation: the whole index follows
                dropped.update(self._per_shard)
                self._entries.clear()
                self._per_shard.clear()
            elif op == "put":
                self._index(*self._check_put(record))
            elif op == "delete":
                self._unindex(UnitKey.parse(str(record[1])))
            else:
                raise ValueError(f"journal {self._journal.path}: unknown record {record!r}")
        for shard in dropped - set(self._per_shard):
            self._files.discard(shard)

    def _owns(self) -> bool:
        """Whether this is the owner. A forked child of the owner becomes a reader of the
        owner's journal, from the start of its generation (which holds the whole index): its
        copy of the owner's index goes stale at once (NOTE [ Owner-only clean-up ])."""
        if self._finalizer is None:
            return False
        if os.getpid() == self._owner_pid:
            return True
        stem, generation = self._journal.stem, self._journal.generation
        self._journal.close()  # the child's copy of the owner's append descriptor
        self._finalizer = None
        self._pending.clear()
        self._entries.clear()
        self._per_shard.clear()
        self._journal = UnitJournal(stem, owner=False, generation=generation)
        return False

    def _index(self, key: UnitKey, entry: ShardEntry) -> None:
        if key in self._entries:
            self._unindex(key)
        self._entries[key] = entry
        self._per_shard[entry.shard] += 1

    def _unindex(self, key: UnitKey) -> bool:
        """Forget a unit; whether its shard now holds none (its descriptor is closed then)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._per_shard[entry.shard] -= 1
        if self._per_shard[entry.shard]:
            return False
        del self._per_shard[entry.shard]
        self._files.discard(entry.shard)
        return True

    def _index_shard(self, path: str) -> None:
        """Index a shard found in the directory (a resumed owner's start)."""
        try:
            entries, bad = read_header(path)
        except FileNotFoundError:
            return
        except CorruptShardError as exc:
            self._corrupt[path] = str(exc)
            return
        for key, entry in entries.items():
            self._index(key, entry)
        self._bad_units.update(bad)

    def _corrupt_shards(self) -> list[tuple[str, str]]:
        """Shard files in the directory that no index names and whose header cannot be read
        (for the message of an unknown unit: it may have been in one)."""
        for path in _shard_paths(self.directory):
            if path in self._per_shard or path in self._corrupt:
                continue
            try:
                read_header(path)
            except CorruptShardError as exc:
                self._corrupt[path] = str(exc)
            except FileNotFoundError:
                continue
        return [(p, why) for p, why in self._corrupt.items() if os.path.exists(p)]

    def _check_put(self, record: Record) -> tuple[UnitKey, ShardEntry]:
        """A put record names a shard file of this directory and a valid spec (never trusted
        blindly: a bad record is an error naming the journal)."""
        try:
            _, raw_key, shard, offset, dtype, shape = record
            key = UnitKey.parse(str(raw_key))
            name = check_segment_name(str(shard))
            if not isinstance(shape, list):
                raise TypeError("shape is not a list")
            spec = UnitSpec(str(dtype), tuple(_int(n) for n in shape))
            ok = (
                name.startswith("shard-")
                and name.endswith(".safetensors")
                and spec.dtype in SUPPORTED_DTYPES
                and all(n >= 0 for n in spec.shape)
                and _int(offset) >= 0
            )
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"journal {self._journal.path}: invalid put record {record!r}")
        return key, ShardEntry(os.path.join(self.directory, name), _int(offset), spec)

    def _maybe_compact(self) -> None:
        """Rewrite the journal as a snapshot once dead records outweigh live ones (64 KiB at
        least; at once when nothing is live), so it follows what is stored, not the run's length."""
        dead = self._journal.size - self._live_bytes
        if dead <= (max(self._live_bytes, _COMPACT_MIN_BYTES) if self._entries else 0):
            return
        sizes = self._journal.rewrite([_put_record(k, e) for k, e in self._entries.items()])
        self._record_bytes = dict(zip(self._entries, sizes, strict=True))
        self._live_bytes = self._journal.size


class _Unsynced:
    """The shards written or changed, and whether the directory changed, since the last sync.

    NOTE [ Durable shards ]: ``save_file`` + ``rename`` and ``pwritev`` leave bytes in the page
    cache; a checkpoint fsynced and committed (NOTE [ Atomic checkpoint directories ] in
    knitkit/job/checkpoint.py) could name units a power loss then takes. A store's state that
    names units calls ``sync`` before it is returned (``TrajectoryStore.state_dict``), so the
    units are durable before any checkpoint holding the state is committed: every shard
    flushed or written in place since the last sync is fsynced, then the directory (new and
    removed shard names), and once the directory's own entry if this backend created it. Only
    there: a flush (every pass serves from one) does not fsync, since a crash before the next
    state loses nothing a state names. Cost (``benchmarks/checkpoint.py --quick --backends
    disk``, 512 trajectories, 3.8 MB of units, ext4, a shared 2-core machine): ``state_dict_s``
    1.894 s with the sync, 1.878 s without (noise is larger). Thread-safe: the driver syncs outside its lock while
    writers go on (what they add meanwhile waits for the next sync); a failed sync leaves the
    set for the next one.
    """

    def __init__(self, directory: str, *, parent: bool) -> None:
        self.directory = directory
        self._shards: set[str] = set()
        self._directory = False
        self._parent = parent
        """The directory was created by this backend: its entry in the parent is new too."""
        self._lock = threading.Lock()

    def wrote(self, shard: str, *, new: bool = False) -> None:
        with self._lock:
            self._shards.add(shard)
            self._directory |= new

    def removed(self, shard: str) -> None:
        with self._lock:
            self._shards.discard(shard)
            self._directory = True

    def sync(self) -> None:
        with self._lock:
            shards, directory, parent = self._shards, self._directory, self._parent
            self._shards, self._directory, self._parent = set(), False, False
        try:
            for shard in sorted(shards):
                with contextlib.suppress(FileNotFoundError):  # deleted since: no state names it
                    _fsync(shard)
            if directory:
                _fsync(self.directory)
            if parent:
                _fsync(os.path.dirname(os.path.abspath(self.directory)))
        except BaseException:
            with self._lock:
                self._shards |= shards
                self._directory |= directory
                self._parent |= parent
            raise


def _fsync(path: str) -> None:
    """Fsync a file or a directory by path (a read-only descriptor suffices on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shard_paths(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "shard-*.safetensors")))


def _put_record(key: UnitKey, entry: ShardEntry) -> Record:
    spec = entry.spec
    return (
        "put",
        str(key),
        os.path.basename(entry.shard),
        entry.offset,
        spec.dtype,
        list(spec.shape),
    )


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _remove_journal(journal: UnitJournal, lock: OwnerLock) -> None:
    """The owner's clean-up: its journal, then its lock (NOTE [ Owner locks ])."""
    journal.close()
    journal.unlink()
    lock.release()


_Piece = tuple[UnitKey, int, memoryview]
"""(unit, absolute file offset, destination bytes) of one contiguous piece of a read."""

_IOV_MAX = 1024
"""Linux's limit on buffers per ``preadv`` call."""

_STAGING = 1 << 20
"""Bytes of whole rows a column read stages per ``preadv`` (NOTE [ Batched disk reads ])."""

_GAP_SKIP = 64 << 10
"""Other columns' bytes per row from which a column read skips them with a ``preadv`` per row
instead of staging them (NOTE [ Batched disk reads ])."""


def _pieces(
    entry: ShardEntry,
    checked: tuple[SeqRange, ...] | None,
    dst: np.ndarray,
    columns: SeqRange | None = None,
) -> list[tuple[int, memoryview]]:
    """The file offsets and destination bytes of one read's ranges (whole unit for ``None``);
    with ``columns`` (checked), a piece per row: its columns (gaps too long to read, NOTE
    [ Batched disk reads ])."""
    row = entry.spec.row_nbytes
    if columns is not None and columns != (0, entry.spec.shape[1]):
        first = entry.offset + row // entry.spec.shape[1] * columns[0]
        rows = dst.reshape(dst.shape[0], -1).view(np.uint8)
        spans = checked or ((0, entry.spec.shape[0]),)
        tokens = (i for start, stop in spans for i in range(start, stop))
        return [(first + i * row, r.data) for i, r in zip(tokens, rows, strict=True)]
    flat = dst.reshape(-1).view(np.uint8).data
    if checked is None:
        return [(entry.offset, flat)] if flat.nbytes else []
    pos, out = 0, []
    for start, stop in checked:
        size = (stop - start) * row
        if size:
            out.append((entry.offset + start * row, flat[pos : pos + size]))
            pos += size
    return out


def _staged(spec: UnitSpec, columns: SeqRange | None) -> bool:
    """Whether a read of ``columns`` goes through a staging buffer (rows no longer than
    ``_STAGING`` whose other columns are shorter than ``_GAP_SKIP``) rather than a piece per
    row (NOTE [ Batched disk reads ])."""
    if columns is None:
        return False
    gap = spec.row_nbytes // spec.shape[1] * (spec.shape[1] - columns[1] + columns[0])
    return 0 < gap < _GAP_SKIP and spec.row_nbytes <= _STAGING


@dataclass(frozen=True, slots=True)
class _ColumnSpan:
    """One token range of a staged column read."""

    key: UnitKey
    offset: int
    """File offset of the first row's first wanted byte."""
    row: int
    """Bytes of a whole row (the stride between rows in the file)."""
    dst: np.ndarray
    """The destination's rows of this range, ``(rows, wanted bytes)`` uint8."""


def _column_spans(
    key: UnitKey,
    entry: ShardEntry,
    checked: tuple[SeqRange, ...] | None,
    dst: np.ndarray,
    columns: SeqRange,
) -> list[_ColumnSpan]:
    """The token ranges of one staged column read (checked ``columns``, a non-empty ``dst``)."""
    row = entry.spec.row_nbytes
    first = entry.offset + row // entry.spec.shape[1] * columns[0]
    rows, at, out = dst.reshape(dst.shape[0], -1).view(np.uint8), 0, []
    for start, stop in checked or ((0, entry.spec.shape[0]),):
        if stop > start:
            out.append(_ColumnSpan(key, first + start * row, row, rows[at : at + stop - start]))
            at += stop - start
    return out


def _read_staged(fd: int, shard: str, spans: list[_ColumnSpan]) -> None:
    """Fill every span's rows: per chunk of rows that fits ``_STAGING`` bytes, one ``preadv`` of
    the bytes from the chunk's first wanted byte to its last into a staging buffer, then one
    strided copy of the wanted columns into the destination (NOTE [ Batched disk reads ])."""
    if not spans:
        return
    staging = np.empty(min(_STAGING, max(s.dst.shape[0] * s.row for s in spans)), np.uint8)
    for span in spans:
        rows, width = span.dst.shape
        per = len(staging) // span.row
        for at in range(0, rows, per):
            n = min(per, rows - at)
            chunk = staging[: n * span.row]
            wanted = chunk[: n * span.row - span.row + width]
            _preadv_exact(fd, [wanted.data], span.offset + at * span.row, shard, span.key)
            span.dst[at : at + n] = chunk.reshape(n, span.row)[:, :width]


def _read_runs(fd: int, shard: str, pieces: list[_Piece]) -> None:
    """Fill every piece from ``fd``, one ``preadv`` per run of file-contiguous pieces.

    NOTE [ Batched disk reads ]: pieces stay in the caller's order (a micro-batch's reads), and
    consecutive pieces whose file bytes follow each other (whole units stored back to back, the
    two CP chunks of a unit that meet) become one ``preadv`` with several destination buffers:
    one system call per contiguous run of the file, not per range.

    A column read (``UnitRead.columns``: a pipeline stage's layers of ``[tokens, layers, topk]``
    routing) wants a slice of each row; the other columns lie between the slices of consecutive
    rows. The kernel reads the file in pages (4 KiB) and a routing row (48 layers x top-8 x
    int32) is 1.5 KiB, so every page of a token range comes from the disk whatever the columns;
    the choice is only what is copied and how many calls it takes. ``_read_staged`` reads, per
    ``_STAGING`` (1 MiB) of rows, the bytes from the first wanted byte to the last with ONE
    ``preadv`` into a staging buffer (the kernel copies the gaps too), then copies the wanted
    columns into the destination in one strided numpy copy: no Python per row, memory bounded
    by the staging buffer. ``bytes_read`` counts the columns alone, the bytes delivered, as the
    in-memory backends do. Measured on 16,384 x 48 x 8 int32 routing (24 MiB in the page cache,
    two CP ranges, ``read_many`` timed in-process, min of 5 x 10 calls, this 2-core machine
    shared and loaded, so +-50%): a stage's 24 layers 2.0 ms staged, all 48 layers 1.5 ms; the
    same 24 layers with ``preadv`` buffers alternating each destination row and one scratch
    buffer for every gap (a call per 512 rows; the kernel copies no more) 6.2 ms, the per-buffer
    costs (a numpy view and a buffer export per row, 32,768 buffers) outweighing a second copy
    of 12 MiB out of a cache-sized buffer; a ``preadv`` per row 40 ms. Where a row's other
    columns reach ``_GAP_SKIP`` (64 KiB, whole pages the kernel need not read; a system call
    per row costs less than copying them), or a row is longer than the staging buffer, each
    row's columns are a piece of their own (``_pieces``) in the runs above instead.
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
    """Fill ``views`` in order from ``offset``, retrying short reads (from the first view not
    filled, linear in the views); a truncated file is a ``CorruptShardError`` naming the shard
    and the unit."""
    first = 0
    while first < len(views):
        n = os.preadv(fd, views[first:] if first else views, offset)
        if n == 0:
            raise CorruptShardError(
                f"shard {shard} ends at byte {offset} while reading unit {key}; "
                "the file was truncated"
            )
        offset += n
        while n:
            if n >= views[first].nbytes:
                n -= views[first].nbytes
                first += 1
            else:
                views[first], n = views[first][n:], 0
