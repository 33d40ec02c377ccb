"""One validation of unit writes, shared by every backend and the store: run it before any state changes."""

from __future__ import annotations

import numpy as np

from knitkit.types import UnitKey

SUPPORTED_DTYPES = frozenset(
    {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"}
    | {"float16", "float32", "float64"}
)
"""dtypes every backend stores and reads back bit-exactly (bfloat16 travels as uint16)."""


def check_name(what: str, name: str, *, context: str = "") -> None:
    """A trajectory id or field name: non-empty printable ASCII (it becomes a file header key)."""
    where = f"{context}: " if context else ""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}{what} {name!r} must be a non-empty string")
    if not (name.isascii() and name.isprintable()):
        raise ValueError(
            f"{where}{what} {name!r} must be printable ASCII (it is stored in shard headers "
            "and journals); rename it"
        )


def check_key(key: UnitKey) -> None:
    """Owner and field of a unit key are valid names; the owner has no '/' (``UnitKey.parse``)."""
    check_name("unit owner", key.owner, context=f"unit {key}")
    check_name("field name", key.field, context=f"unit {key}")
    if "/" in key.owner:
        raise ValueError(f"unit {key}: owner {key.owner!r} may not contain '/'")


def check_dtype(key: UnitKey, dtype: np.dtype) -> None:
    """Reject dtypes no backend can store faithfully (complex, object, unicode, structured, ...)."""
    if dtype.fields is not None or dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"unit {key}: dtype {dtype.str!r} ({dtype.name}) is not storable; "
            f"use one of {sorted(SUPPORTED_DTYPES)} (store bfloat16 as uint16)"
        )


def check_unit(key: UnitKey, array: np.ndarray | np.generic | float | int) -> np.ndarray:
    """Validate one unit write; returns it as a native-byte-order array (a view when it already is).

    Raises ``ValueError`` / ``TypeError`` naming the unit (trajectory and field) and the value.
    """
    check_key(key)
    value = np.asarray(array)
    check_dtype(key, value.dtype)
    if not value.dtype.isnative:
        value = value.astype(value.dtype.newbyteorder("="))
    return value
