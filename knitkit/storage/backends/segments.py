"""Names of knitkit's /dev/shm segments: checked against path traversal, and reclaimed from dead owners.

NOTE [ Segment names ]: every segment knitkit creates carries its creator's pid in its name
(backend slabs and journals ``knitkit-<pid>-<hex>-...``, slot rings ``knitkit_<pid>_<hex>``), and
the random part keeps a name from ever being reused, even after a failed creation. An owner
unlinks its segments on every exit it sees (``close``, finalizers, SIGINT, SIGTERM); only SIGKILL
(or a crash in C) leaves them behind. ``sweep_dead_segments`` removes the segments, owned by this
user, whose creator pid no longer runs: a shared-memory backend calls it at start-up for backend
segments, and ``knitkit shm-clean`` runs it by hand for rings too. A segment whose pid was
reused by another process stays until that process exits (never removed while a live pid
carries its name). Pids are only meaningful on one node and in one pid namespace: containers
that share /dev/shm across pid namespaces must not sweep.
"""

from __future__ import annotations

import contextlib
import os
import re

SHM_DIR = "/dev/shm"
_MAX_NAME = 255
_OWNED = re.compile(r"^knitkit[-_](\d+)[-_][0-9a-f]{8}([-_].*)?$")
"""Backend segments (``knitkit-<pid>-<hex>-...``) and slot rings (``knitkit_<pid>_<hex>``)."""


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs on this node and is not a zombie."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


def check_segment_name(name: str) -> str:
    """A segment name is one path component: no '/', not '.' or '..', no NUL, at most 255 bytes."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\0" in name
        or len(name.encode()) > _MAX_NAME
    ):
        raise ValueError(
            f"segment name {name!r} is not a single file name under /dev/shm "
            "(no '/', '..' or NUL, 1-255 bytes)"
        )
    return name


def segment_pid(name: str) -> int | None:
    """The creator pid carried by a knitkit segment name, or ``None`` for other names."""
    match = _OWNED.match(name)
    return int(match.group(1)) if match else None


def sweep_dead_segments(
    directory: str = SHM_DIR, *, rings: bool = True, dry_run: bool = False
) -> list[str]:
    """Unlink this user's knitkit segments in ``directory`` whose creator pid is dead.

    ``rings=False`` keeps slot rings (``knitkit_<pid>_...``): a ring is named by the process
    that made its spec, which need not be the one that owns it, so only a person (``knitkit
    shm-clean``) removes those. Returns the paths removed (or that would be, with ``dry_run``).
    See NOTE [ Segment names ].
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    uid = os.getuid()
    for name in sorted(names):
        pid = segment_pid(name)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        if not rings and name.startswith("knitkit_"):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(path).st_uid != uid:
                continue
            if not dry_run:
                os.unlink(path)
            removed.append(path)
    return removed
