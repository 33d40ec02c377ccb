"""Open file descriptors of disk shards: an LRU with a fixed bound, closed when a shard is deleted."""

from __future__ import annotations

import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager


class OpenShards:
    """At most ``capacity`` shard files open at once, least recently used closed first.

    NOTE [ Open shards ]: ``preadv`` / ``pwritev`` take explicit offsets, so threads may share one
    descriptor without a seek lock. A descriptor in use (inside ``use``) is never closed under
    its reader: eviction and ``discard`` skip or defer it until its last user leaves, so the
    bound can be exceeded by the number of concurrent readers, never more. A descriptor opened
    read-only is reopened read-write once a write needs it.
    """

    def __init__(self, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"max_open_shards={capacity} must be >= 1")
        self.capacity = capacity
        self._fds: OrderedDict[str, tuple[int, bool]] = OrderedDict()
        self._busy: Counter[int] = Counter()
        self._retired: set[int] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._fds) + len(self._retired)

    @contextmanager
    def use(self, path: str, *, write: bool = False) -> Iterator[int]:
        """A descriptor of ``path`` (read-write if ``write``), open for the duration of the block."""
        with self._lock:
            fd = self._acquire(path, write)
            self._busy[fd] += 1
        try:
            yield fd
        finally:
            with self._lock:
                self._busy[fd] -= 1
                if not self._busy[fd]:
                    del self._busy[fd]
                    if fd in self._retired:
                        self._retired.discard(fd)
                        os.close(fd)
                self._evict()

    def discard(self, path: str) -> None:
        """Close ``path``'s descriptor (its shard is being deleted)."""
        with self._lock:
            entry = self._fds.pop(path, None)
            if entry is not None:
                self._retire(entry[0])

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                self._retire(fd)
            self._fds.clear()

    def _acquire(self, path: str, write: bool) -> int:
        entry = self._fds.get(path)
        if entry is not None and (entry[1] or not write):
            self._fds.move_to_end(path)
            return entry[0]
        fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
        if entry is not None:
            self._retire(entry[0])
        self._fds[path] = (fd, write)
        self._fds.move_to_end(path)
        self._evict()
        return fd

    def _evict(self) -> None:
        for path in list(self._fds)[:-1]:  # never the most recent: it is about to be used
            if len(self._fds) <= self.capacity:
                return
            fd = self._fds[path][0]
            if not self._busy[fd]:
                del self._fds[path]
                os.close(fd)

    def _retire(self, fd: int) -> None:
        if self._busy[fd]:
            self._retired.add(fd)
        else:
            os.close(fd)
