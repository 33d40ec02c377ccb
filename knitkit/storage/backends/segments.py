"""Names of knitkit's /dev/shm segments: checked against path traversal, and reclaimed from dead owners.

NOTE [ Segment names ]: every segment knitkit creates carries a random part that keeps its name
from ever being reused, even after a failed creation, and its creator's pid (backend slabs and
journals ``knitkit-<pid>-<hex>-...``, slot rings ``knitkit_<pid>_<hex>``). The pid is only a
hint for people: a pid means nothing in another pid namespace, and containers that share /dev/shm
(``--ipc=host``, common for NCCL jobs) do not share pids. What says an owner is alive is a kernel
lock (NOTE [ Owner locks ]). An owner unlinks its segments on every exit it sees (``close``,
finalizers, SIGINT, SIGTERM); only SIGKILL (or a crash in C) leaves them behind, and
``sweep_dead_segments`` removes them:
- backend segments: the group ``knitkit-<pid>-<hex>-*`` goes once its lock file
  ``knitkit-<pid>-<hex>-lock`` can be locked (its owner is dead, in whatever namespace it ran);
  a group without a lock file (written by a knitkit before owner locks) goes only when its pid
  is dead in this namespace, as before;
- slot rings: a ring ``knitkit_<pid>_<hex>`` goes once its owner's byte lock on the ring file
  itself can be taken (NOTE [ Ring role locks ]), in whatever namespace the owner ran, unless its
  pid is alive in this namespace: a ring of a knitkit before role locks holds no lock while its
  owner lives, and a lock-free ring whose pid lives here cannot be told from one (it waits for
  a later sweep; a dead owner's pid is rarely reused at once);
- nothing else: names that are not knitkit's, other users' files, anything that is not a regular
  file (a directory named like a segment is skipped, never a reason to fail).
A shared-memory backend sweeps its directory at start-up (rings included), and so does the first
ring a process creates (``SlotRing.create``), so a job started after a whole-job SIGKILL removes
what the killed one left, whatever its store.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import struct
from collections import defaultdict
from dataclasses import dataclass, field

SHM_DIR = "/dev/shm"
_MAX_NAME = 255
_OWNED = re.compile(r"^knitkit[-_](\d+)[-_][0-9a-f]{8}([-_].*)?$")
"""Backend segments (``knitkit-<pid>-<hex>-...``) and slot rings (``knitkit_<pid>_<hex>``)."""
_GROUP = re.compile(r"^(knitkit-\d+-[0-9a-f]{8})(-.*)?$")
"""A backend owner's group: every segment named ``<group>-...``."""
LOCK_SUFFIX = "-lock"
RING_OWNER_BYTE = 0
"""The byte of a ring file its owner locks (NOTE [ Ring role locks ] in slot_ring.py)."""
_FLOCK = struct.Struct("hhqqi4x")
"""``struct flock`` (x86-64 and aarch64): l_type, l_whence, l_start, l_len, l_pid."""


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs on this node, in this pid namespace, and is not a zombie."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            state = stat_file.read().rsplit(b")", 1)[1].split()[0]
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


class OwnerLock:
    """An exclusive ``flock`` on ``<directory>/<group>-lock``, held for the owner's lifetime.

    NOTE [ Owner locks ]: an owner's segments are live exactly while its lock is held. The kernel
    drops a ``flock`` when the last descriptor of its open file goes, so the lock dies with its
    owner however the owner ends (SIGKILL included), and a lock is one inode: processes in
    different pid namespaces that share the file system see the same lock. A sweeper removes a
    group only while it holds the group's lock itself, so it never races a live owner. The lock
    file is created and locked under a name the sweep ignores (``.<group>-lock``) and renamed into
    place, so it is never visible unlocked; the owner creates it before its first segment and
    unlinks it after its last. A forked child inherits the descriptor and keeps the lock (and the
    segments) alive until it exits too: conservative, never a removal under a live reader. Nobody
    calls ``LOCK_UN``: only closing the last descriptor releases it.

    Why names and a lock, not anonymous ``memfd`` segments passed as descriptors: a memfd needs
    no sweep and can be sealed against shrinking, but every reader must then receive a
    descriptor for every slab, including slabs the owner creates later. Our readers are not
    the owner's children: torchrun starts the trainer ranks, Ray starts reorganizer actors on
    their node, and a reader follows the journal to slabs made after it attached. Passing fds
    would need a Unix-socket rendezvous per reader and per new slab (``SCM_RIGHTS``), a server
    thread in the owner, and a path for Ray workers that cannot inherit descriptors; a name in
    a shared tmpfs needs none of that. What was wrong was only the liveness test, and a kernel
    lock answers it correctly in every namespace.
    """

    def __init__(self, directory: str, group: str) -> None:
        self.path = os.path.join(directory, check_segment_name(f"{group}{LOCK_SUFFIX}"))
        staging = os.path.join(directory, f".{group}{LOCK_SUFFIX}")
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(staging, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        """Unlink the lock file, then drop the lock (call after every segment is unlinked)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


def lock_byte(fd: int, byte: int) -> bool:
    """Take an exclusive open-file-description lock on ``byte`` of ``fd``'s file (never
    blocks); False if another open file description holds it. Released only when every
    descriptor of this open file description is closed (NOTE [ Ring role locks ])."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def byte_locked(fd: int, byte: int) -> bool:
    """Whether an open file description other than ``fd``'s holds a lock on ``byte``."""
    probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0)
    return _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe))[0] != fcntl.F_UNLCK


@dataclass(slots=True)
class SweepReport:
    """What a sweep removed (or would, in a dry run) and what it left and why."""

    removed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """Paths that look like a dead owner's but could not be removed: the reason."""


def sweep_dead_segments(
    directory: str = SHM_DIR, *, rings: bool = True, dry_run: bool = False
) -> SweepReport:
    """Unlink this user's knitkit segments in ``directory`` whose owner is dead (see
    NOTE [ Segment names ] for exactly what goes and NOTE [ Owner locks ] for how liveness is
    decided). ``rings=False`` keeps slot rings. Never raises for one entry it cannot handle:
    the report says why it was skipped.
    """
    report = SweepReport()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return report
    groups: dict[str, list[str]] = defaultdict(list)
    for name in sorted(names):
        if segment_pid(name) is None:
            continue
        if name.startswith("knitkit_"):
            if rings:
                _sweep_ring(directory, name, dry_run, report)
            continue
        match = _GROUP.match(name)
        if match:
            groups[match.group(1)].append(name)
    for group, members in groups.items():
        _sweep_group(directory, group, members, dry_run, report)
    return report


def _regular_and_mine(path: str, report: SweepReport) -> bool:
    """A regular file owned by this user (anything else is skipped, with the reason)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        report.skipped[path] = f"cannot stat: {exc}"
        return False
    if not stat.S_ISREG(info.st_mode):
        report.skipped[path] = "not a regular file"
        return False
    return info.st_uid == os.getuid()


def _try_lock(path: str) -> int | None:
    """A descriptor holding ``path``'s exclusive lock, or ``None`` if a live owner holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlink(paths: list[str], dry_run: bool, report: SweepReport) -> None:
    for path in paths:
        try:
            if not dry_run:
                os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            report.skipped[path] = f"cannot unlink: {exc}"
            continue
        report.removed.append(path)


def _sweep_group(
    directory: str, group: str, members: list[str], dry_run: bool, report: SweepReport
) -> None:
    """One backend owner's segments: removed while holding its lock (or, lock-less, by pid)."""
    lock = f"{group}{LOCK_SUFFIX}"
    paths = [os.path.join(directory, n) for n in members if n != lock]
    lock_path = os.path.join(directory, lock)
    if lock not in members:  # written before owner locks: the pid rule, this namespace only
        pid = segment_pid(group)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            return
        _unlink([p for p in paths if _regular_and_mine(p, report)], dry_run, report)
        return
    if not _regular_and_mine(lock_path, report):
        return
    try:
        fd = _try_lock(lock_path)
    except FileNotFoundError:
        return  # its owner is closing right now
    except OSError as exc:
        report.skipped[lock_path] = f"cannot lock: {exc}"
        return
    if fd is None:
        return  # a live owner holds it
    try:
        _unlink([p for p in paths if _regular_and_mine(p, report)], dry_run, report)
        _unlink([lock_path], dry_run, report)
    finally:
        os.close(fd)


def _sweep_ring(directory: str, name: str, dry_run: bool, report: SweepReport) -> None:
    """A slot ring: removed while holding its owner's byte lock (its owner is gone), unless its
    pid is alive here (NOTE [ Segment names ]: it may be a lock-less ring of an older knitkit)."""
    path = os.path.join(directory, name)
    if pid_alive(segment_pid(name) or 0) or not _regular_and_mine(path, report):
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return  # its owner unlinked it right now
    except OSError as exc:
        report.skipped[path] = f"cannot open: {exc}"
        return
    try:
        if lock_byte(fd, RING_OWNER_BYTE):
            _unlink([path], dry_run, report)
    except OSError as exc:
        report.skipped[path] = f"cannot lock: {exc}"
    finally:
        os.close(fd)
