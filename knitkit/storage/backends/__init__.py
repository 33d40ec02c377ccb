"""Unit backends: put / replace / ranged read / delete over memory, /dev/shm and safetensors (README step 3).

The face for backend authors: the ``UnitBackend`` Protocol, the shared read body
(``ReadCounter``) and the validators every backend runs before it changes state.
"""

from knitkit.storage.backends.backend import UnitBackend, UnitSpec
from knitkit.storage.backends.disk import SafetensorsBackend
from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.backends.ranges import (
    ReadCounter,
    check_ranges,
    check_replacement,
    copy_ranges,
    destination,
    rows_of,
    spec_of,
)
from knitkit.storage.backends.shard_header import CorruptShardError, read_header
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.backends.validate import SUPPORTED_DTYPES, check_unit

__all__ = [
    "SUPPORTED_DTYPES",
    "CorruptShardError",
    "MemoryBackend",
    "ReadCounter",
    "SafetensorsBackend",
    "SharedMemoryBackend",
    "UnitBackend",
    "UnitSpec",
    "check_ranges",
    "check_replacement",
    "check_unit",
    "copy_ranges",
    "destination",
    "read_header",
    "rows_of",
    "spec_of",
]
