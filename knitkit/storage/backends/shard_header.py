"""Safetensors shard headers, validated: size bounds, offsets inside the file and equal to dtype x shape."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from knitkit.storage.backends.backend import UnitSpec
from knitkit.types import UnitKey

_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16"}
_DTYPES |= {"F16": "float16", "U32": "uint32", "I32": "int32", "F32": "float32"}
_DTYPES |= {"U64": "uint64", "I64": "int64", "F64": "float64"}
_MAX_HEADER = 100 << 20
"""safetensors' own limit on the JSON header."""


class CorruptShardError(ValueError):
    """A shard file (or one unit's entry in it) is malformed or truncated; the message names the file."""


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """Where one unit lies in a shard file: absolute byte offset of its first row, and its spec."""

    shard: str
    offset: int
    spec: UnitSpec


def read_header(path: str) -> tuple[dict[UnitKey, ShardEntry], dict[UnitKey, str]]:
    """Parse and check a shard's header once: its valid entries, and why each invalid one is not.

    Raises ``CorruptShardError`` naming the file when the header itself cannot be read (file
    shorter than its header, header length out of bounds, not a JSON object). An entry whose
    dtype, shape or offsets are wrong, or whose bytes lie past the end of the file (a truncated
    shard), is returned among the invalid ones: only that unit fails.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CorruptShardError(f"shard {path}: {size} bytes, too short for a header length")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER):
            raise CorruptShardError(
                f"shard {path}: header length {length} exceeds the file ({size} bytes) or "
                f"{_MAX_HEADER} bytes"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptShardError(f"shard {path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptShardError(f"shard {path}: header is not a JSON object")
    base = 8 + length
    entries: dict[UnitKey, ShardEntry] = {}
    bad: dict[UnitKey, str] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            key = UnitKey.parse(name)
        except ValueError:
            continue  # not a knitkit unit: nothing can ask for it
        try:
            entries[key] = _entry(path, base, size, info)
        except CorruptShardError as exc:
            bad[key] = str(exc)
    return entries, bad


def _entry(path: str, base: int, size: int, info: Any) -> ShardEntry:
    if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
        raise CorruptShardError(f"shard {path}: entry {info!r} has no supported dtype")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(_count(n) for n in shape)):
        raise CorruptShardError(f"shard {path}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(n) for n in offsets)):
        raise CorruptShardError(f"shard {path}: data_offsets {offsets!r} are not [begin, end]")
    spec = UnitSpec(_DTYPES[info["dtype"]], tuple(shape))
    begin, end = offsets
    expected = np.dtype(spec.dtype).itemsize * int(np.prod(spec.shape, dtype=np.int64))
    if end - begin != expected:
        raise CorruptShardError(
            f"shard {path}: data_offsets {offsets} span {end - begin} bytes; "
            f"{spec.dtype}{list(spec.shape)} needs {expected}"
        )
    if base + end > size:
        raise CorruptShardError(
            f"shard {path}: bytes [{base + begin}, {base + end}) lie past its end ({size} bytes); "
            "the file is truncated"
        )
    return ShardEntry(path, base + begin, spec)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
