"""Unit backends: put / replace / ranged read and write / delete over memory, /dev/shm and safetensors (README step 3).

The face for backend authors: the ``UnitBackend`` Protocol (``check_backend``), the optional
``UnitBytes`` capability (units as bytes this process maps, read in place by a reorganizer's copy
lists, a range of an assignment's units at a time: ``UnitViews``; ``check_need`` is its check), the shared read and write bodies (``ReadCounter``,
``check_write``), the validators every backend runs before it
changes state, ``UnitsLostError`` for units a backend can no longer read, and the owner-only
finalizer for clean-ups of shared resources (``pid_alive``: whether a segment's owner runs).
"""

from knitkit.storage.backends.backend import (
    WHOLE,
    UnitBackend,
    UnitBytes,
    UnitNeed,
    UnitSpec,
    UnitViews,
    check_backend,
)
from knitkit.storage.backends.disk import SafetensorsBackend
from knitkit.storage.backends.lost import UnitsLostError, lost_units_in
from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.backends.owner import OwnerFinalizer
from knitkit.storage.backends.ranges import (
    ReadCounter,
    check_columns,
    check_need,
    check_ranges,
    check_replacement,
    check_write,
    copy_ranges,
    copy_read,
    destination,
    open_read,
    paste_ranges,
    rows_of,
    spec_of,
)
from knitkit.storage.backends.segments import pid_alive
from knitkit.storage.backends.shard_header import CorruptShardError, read_header
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.backends.validate import SUPPORTED_DTYPES, check_unit

__all__ = [
    "SUPPORTED_DTYPES",
    "WHOLE",
    "CorruptShardError",
    "MemoryBackend",
    "OwnerFinalizer",
    "ReadCounter",
    "SafetensorsBackend",
    "SharedMemoryBackend",
    "UnitBackend",
    "UnitBytes",
    "UnitNeed",
    "UnitSpec",
    "UnitViews",
    "UnitsLostError",
    "check_backend",
    "check_columns",
    "check_need",
    "check_ranges",
    "check_replacement",
    "check_unit",
    "check_write",
    "copy_ranges",
    "copy_read",
    "destination",
    "lost_units_in",
    "open_read",
    "paste_ranges",
    "pid_alive",
    "read_header",
    "rows_of",
    "spec_of",
]
