"""A /dev/shm journal of unit locations, so readers in other processes see later writes; compacted by its owner."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterable, Iterator

from knitkit.storage.backends.segments import check_segment_name

_LENGTH = struct.Struct("<I")
_MAX_RECORD = 1 << 20
_REOPEN_TRIES = 100

Record = tuple[str | int | list[int], ...]
"""One journal record: an op name followed by strings, integers and integer lists (JSON data only)."""

RESET = "reset"
"""First record of every generation after the first: forget all units, the snapshot follows."""
MOVED = "moved"
"""Last record of a compacted generation: continue in the generation it names."""


class UnitJournal:
    """One writer appends records; readers replay the records appended since they last looked.

    NOTE [ Unit journal ]: the owner of a shared-memory or disk backend appends one
    length-prefixed JSON record per change (a new slab, a put with the unit's location, a
    delete) with ``os.write`` on an ``O_APPEND`` file, and only after the unit's bytes are in
    place. Records are data only (JSON lists of strings and integers): a reader never runs code
    written by another process. A reader keeps its byte offset into the journal and, before each
    lookup, replays whatever complete records were appended since; a record still being written
    (short length or payload) is left for the next look. So a long-lived reader (a reorganizer
    process started before the rollout began, or before a resumed store deleted what its
    checkpoint does not name) sees every unit written before the plan that names it was sent,
    never a unit whose bytes are not ready, and never a deleted unit's old location: a unit
    deleted and put again under the same key is read at its new place (the journal is the
    reader's whole index, in the owner's order).

    Compaction: the journal lives in generations ``<stem>-<n>``. ``rewrite(snapshot)`` writes
    generation n+1 whole (``RESET`` then the live state) before it appends ``MOVED n+1`` to
    generation n and unlinks n; so a reader that meets ``MOVED`` finds a complete successor. A
    reader whose successor was itself compacted away meanwhile (or that attaches to a generation
    already gone) opens the newest generation from its start: every generation begins with the
    full state, so nothing is missed. Only the owner unlinks the journal, together with its slabs.
    """

    def __init__(self, stem: str, *, owner: bool, generation: int = 0, offset: int = 0) -> None:
        """``stem`` is ``<directory>/<segment name>``; a reader starts replaying at ``offset`` of
        ``generation`` (records before it are already known)."""
        check_segment_name(os.path.basename(stem))
        self.stem = stem
        self.owner = owner
        self.generation = generation
        self._offset = offset
        self._pending = b""
        if owner:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
            self._fd: int | None = os.open(self.path, flags, 0o600)
        else:
            self._fd = None
            self._open_reader(generation, offset)

    @property
    def path(self) -> str:
        """The current generation's file."""
        return f"{self.stem}-{self.generation}"

    @property
    def size(self) -> int:
        """Bytes in the current generation."""
        return os.fstat(self._require_fd()).st_size

    @property
    def open(self) -> bool:
        """Whether this instance still holds its descriptor (``close`` drops it)."""
        return self._fd is not None

    @property
    def offset(self) -> int:
        """Bytes of the current generation this instance has already replayed (readers)."""
        return self._offset

    def append(self, record: Record) -> int:
        """Append one record with a single write; returns its size in bytes."""
        return self.extend([record])[0]

    def extend(self, records: Iterable[Record]) -> list[int]:
        """Append records in one write (a reader may see a prefix of them: it replays only
        complete records); returns each one's size in bytes."""
        blobs = [_encode(r) for r in records]
        _write_all(self._require_fd(), b"".join(blobs))
        return [len(b) for b in blobs]

    def rewrite(self, snapshot: Iterable[Record]) -> list[int]:
        """Owner: start a new generation holding ``RESET`` + ``snapshot`` and retire the current
        one; returns the size in bytes of each snapshot record."""
        assert self.owner, "only the journal's owner compacts it"
        old_fd, old_path = self._require_fd(), self.path
        blobs = [_encode(r) for r in snapshot]
        self.generation += 1
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
        fd = os.open(self.path, flags, 0o600)
        try:
            _write_all(fd, b"".join((_encode((RESET,)), *blobs)))
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            self.generation -= 1
            raise
        os.write(old_fd, _encode((MOVED, self.generation)))
        self._fd = fd
        os.close(old_fd)
        os.unlink(old_path)
        return [len(b) for b in blobs]

    def new_records(self) -> Iterator[Record]:
        """Records appended since the previous call (complete ones only), following compactions."""
        while True:
            fd = self._fd
            if fd is None:
                raise ValueError(f"journal {self.path} is closed")
            size = os.fstat(fd).st_size
            if size > self._offset:
                self._pending += os.pread(fd, size - self._offset, self._offset)
                self._offset = size
            moved: int | None = None
            at = 0
            while len(self._pending) - at >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(self._pending, at)
                if length > _MAX_RECORD:
                    raise ValueError(f"journal {self.path}: record of {length} bytes at {at}")
                end = at + _LENGTH.size + length
                if end > len(self._pending):
                    break
                record = _decode(self.path, self._pending[at + _LENGTH.size : end])
                at = end
                if record[0] == MOVED:
                    if len(record) != 2 or not isinstance(record[1], int):
                        raise ValueError(f"journal {self.path}: bad {MOVED} record {record!r}")
                    moved = record[1]
                    break
                yield record
            self._pending = self._pending[at:]
            if moved is None:
                return
            self._open_reader(moved, 0)

    def unlink(self) -> None:
        """Owner: remove the current generation (earlier ones are gone already)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open_reader(self, generation: int, offset: int) -> None:
        """Open ``generation`` at ``offset``, or the newest generation from its start if it is gone."""
        for _ in range(_REOPEN_TRIES):
            try:
                fd = os.open(f"{self.stem}-{generation}", os.O_RDONLY)
                break
            except FileNotFoundError:
                newest = self._newest_generation()
                if newest is None or newest == generation:
                    raise FileNotFoundError(
                        f"journal {self.stem}-{generation} is gone and no newer generation "
                        "exists; its owner has closed the shared-memory backend"
                    ) from None
                generation, offset = newest, 0
        else:
            raise FileNotFoundError(f"journal {self.stem}: generations vanish faster than read")
        self.close()
        self._fd, self.generation, self._offset, self._pending = fd, generation, offset, b""

    def _newest_generation(self) -> int | None:
        directory, stem = os.path.split(self.stem)
        found = [
            int(suffix)
            for name in os.listdir(directory)
            if name.startswith(f"{stem}-") and (suffix := name[len(stem) + 1 :]).isdigit()
        ]
        return max(found, default=None)

    def _require_fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"journal {self.path} is closed")
        return self._fd


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a regular file takes it in one call, save on a
    signal or a full disk)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _encode(record: Record) -> bytes:
    payload = json.dumps(record, separators=(",", ":")).encode()
    return _LENGTH.pack(len(payload)) + payload


def _decode(path: str, payload: bytes) -> Record:
    """A record is a JSON list starting with its op name; anything else is a corrupt journal."""
    try:
        record = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"journal {path}: corrupt record ({exc})") from None
    if not isinstance(record, list) or not record or not isinstance(record[0], str):
        raise ValueError(f"journal {path}: record {record!r} is not [op, ...]")
    return tuple(record)
