"""An append-only /dev/shm journal of unit locations, so readers in other processes see later writes."""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Iterator
from typing import Any

_LENGTH = struct.Struct("<I")


class UnitJournal:
    """One writer appends records; readers replay the records appended since they last looked.

    NOTE [unit journal]: the owner of a shared-memory backend appends one length-prefixed pickle
    record per change (a new slab, a put, a delete) with a single ``os.write`` on an ``O_APPEND``
    file, and only after the unit's bytes are in place. A reader keeps its byte offset into the
    journal and, before each lookup, replays whatever complete records were appended since; a
    record still being written (short length or payload) is left for the next look. So a
    long-lived reader (a reorganizer process started before the rollout began) sees every unit
    written before the plan that names it was sent, and never a unit whose bytes are not ready.
    Only the owner unlinks the journal, together with its slabs.
    """

    def __init__(self, path: str, *, owner: bool, offset: int = 0) -> None:
        """A reader starts replaying at ``offset`` (records before it are already known)."""
        self.path = path
        self.owner = owner
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND if owner else os.O_RDONLY
        self._fd: int | None = os.open(path, flags, 0o600)
        self._offset = offset
        self._pending = b""

    @property
    def size(self) -> int:
        """Bytes appended so far."""
        assert self._fd is not None, "journal is closed"
        return os.fstat(self._fd).st_size

    def append(self, record: tuple[Any, ...]) -> None:
        payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        assert self._fd is not None, "journal is closed"
        os.write(self._fd, _LENGTH.pack(len(payload)) + payload)

    def new_records(self) -> Iterator[tuple[Any, ...]]:
        """Records appended since the previous call (complete ones only)."""
        assert self._fd is not None, "journal is closed"
        size = os.fstat(self._fd).st_size
        if size > self._offset:
            self._pending += os.pread(self._fd, size - self._offset, self._offset)
            self._offset = size
        view, at = self._pending, 0
        while len(view) - at >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(view, at)
            end = at + _LENGTH.size + length
            if end > len(view):
                break
            yield pickle.loads(view[at + _LENGTH.size : end])
            at = end
        self._pending = view[at:]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
