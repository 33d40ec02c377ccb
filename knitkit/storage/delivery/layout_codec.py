"""A micro-batch layout as compact binary metadata: struct-packed tables, no JSON, no pickle.

A consumer decodes one layout per micro-batch on its critical path, right after waking up from
compute with cold caches; JSON plus per-field dtype parsing took 150-300 us there. The binary form
decodes with a handful of ``struct`` calls and checks every offset and size it decodes against the
slot, so bytes another process wrote are data only: a corrupt or hostile record raises
``LayoutDecodeError`` naming the field, never runs code and never yields a view past the slot, a
misaligned view, a dimension larger than the slot, two fields over the same bytes or two fields
of one name.

Record (little-endian): a header (magic, ``nbytes``, table sizes), the field table (offset, dtype
code, ndim, shape), ``cu_seqlens_padded`` as int64, the extras table (kind, int, float) and one
UTF-8 blob of every string, each followed by NUL (so no string may contain NUL), in order:
field names, trajectory ids, unit keys, extra keys, then the extras' string values. Decoding is
one ``struct`` call per table and one ``split`` for the strings: the fewer instructions, the
less a consumer pays for them right after it wakes up.
"""

from __future__ import annotations

import itertools
import math
import struct

import numpy as np

from knitkit.storage.backends.validate import SUPPORTED_DTYPES
from knitkit.storage.planning.plan import build_many
from knitkit.types import LAYOUT_ALIGNMENT, FieldView, MicroBatchLayout, UnitKey

_MAGIC = b"KKL1"
_HEADER = struct.Struct("<4sq7I")
"""magic, nbytes, then counts: fields, cu_seqlens_padded, trajectory ids, units, extras,
strings, string bytes (NULs included)."""
MAX_NDIM = 6
"""Most dimensions a field may have."""
_FIELD = struct.Struct(f"<QBB6x{MAX_NDIM}Q")
"""offset, dtype code, ndim, padding, shape (unused dimensions 0); unsigned, so no decoded
offset or dimension is negative."""
_EXTRA = struct.Struct("<B7xqd")
"""kind (_INT, _FLOAT, _STR), integer value or string index, float value."""
_INT, _FLOAT, _STR = 0, 1, 2
DTYPES = tuple((name, np.dtype(name).itemsize) for name in sorted(SUPPORTED_DTYPES))
"""dtype codes (index) with their item sizes: the dtypes every backend stores, plain numeric
ones only (bfloat16 travels as uint16), so no decoded field can hold Python objects."""
_CODES = {name: code for code, (name, _) in enumerate(DTYPES)}
_NUM_DTYPES = len(DTYPES)


class LayoutDecodeError(ValueError):
    """Slot metadata that is not a valid layout for its slot (corrupt or hostile bytes)."""


def encode_layout(layout: MicroBatchLayout) -> bytes:
    """``layout`` as a binary record; ``ValueError`` naming the field (or string) for a dtype
    without a code, more than ``MAX_NDIM`` dimensions, or a string holding NUL."""
    strings = [view.name for view in layout.fields]
    strings += layout.trajectory_ids
    strings += [str(key) for key in layout.units]
    strings += layout.extra
    fields = bytearray()
    for view in layout.fields:
        code = _CODES.get(view.dtype)
        if code is None or len(view.shape) > MAX_NDIM:
            raise ValueError(
                f"field {view.name!r}: {view.dtype}{list(view.shape)} cannot travel through a slot "
                f"ring; use one of {[n for n, _ in DTYPES]} with at most {MAX_NDIM} dimensions "
                "(bfloat16 as uint16)"
            )
        shape = (*view.shape, *(0,) * (MAX_NDIM - len(view.shape)))
        fields += _FIELD.pack(view.offset, code, len(view.shape), *shape)
    extras = bytearray()
    for name, value in layout.extra.items():
        if isinstance(value, str):
            extras += _EXTRA.pack(_STR, len(strings), 0.0)
            strings.append(value)
        elif isinstance(value, int):  # bool included: stored as its int
            extras += _EXTRA.pack(_INT, value, 0.0)
        elif isinstance(value, float):
            extras += _EXTRA.pack(_FLOAT, 0, value)
        else:
            raise ValueError(
                f"extra {name!r} is a {type(value).__name__}; extras are int, float or str"
            )
    text = "".join(s + "\0" for s in strings)
    if text.count("\0") != len(strings):
        bad = next(s for s in strings if "\0" in s)
        raise ValueError(f"{bad!r} holds NUL; names, ids and extras travel NUL-terminated")
    chars = text.encode()
    cu = layout.cu_seqlens_padded
    counts = (len(cu), len(layout.trajectory_ids), len(layout.units), len(layout.extra))
    return b"".join(
        (
            _HEADER.pack(
                _MAGIC, layout.nbytes, len(layout.fields), *counts, len(strings), len(chars)
            ),
            fields,
            struct.pack(f"<{len(cu)}q", *cu),
            extras,
            chars,
        )
    )


def decode_layout(blob: bytes, capacity: int) -> MicroBatchLayout:
    """Inverse of ``encode_layout`` for a slot of ``capacity`` bytes; ``LayoutDecodeError``
    naming what is wrong for any record that is malformed or reaches past the slot."""
    try:
        magic, nbytes, n_fields, n_cu, n_traj, n_units, n_extra, n_strings, n_chars = (
            _HEADER.unpack_from(blob)
        )
    except struct.error:
        raise LayoutDecodeError(f"{len(blob)} bytes is shorter than the header") from None
    at = _HEADER.size + n_fields * _FIELD.size
    tables = at + 8 * n_cu + n_extra * _EXTRA.size
    if magic != _MAGIC or tables + n_chars != len(blob):
        raise LayoutDecodeError(
            f"header (magic {magic!r}, {n_fields} fields, {n_cu} cu_seqlens, {n_extra} extras, "
            f"{n_chars} string bytes) does not describe a {len(blob)}-byte record"
        )
    if not 0 <= nbytes <= capacity:
        raise LayoutDecodeError(f"nbytes={nbytes} outside the slot's {capacity} bytes")
    try:
        strings = blob[tables:].decode().split("\0")
    except UnicodeDecodeError as exc:
        raise LayoutDecodeError(f"the strings are not UTF-8 ({exc.reason})") from None
    names = n_fields + n_traj + n_units
    if strings.pop() or len(strings) != n_strings or n_strings < names + n_extra:
        raise LayoutDecodeError(f"{n_strings} strings expected, the record holds {len(strings)}")
    rows = list(_FIELD.iter_unpack(blob[_HEADER.size : at]))
    dtypes, shapes, offsets = [], [], []
    spans: list[tuple[int, int, str]] = []
    # one pass, no per-field generator: a consumer decodes every micro-batch (issue 31)
    for name, row in zip(strings, rows, strict=False):
        offset, code, ndim = row[0], row[1], row[2]
        if code >= _NUM_DTYPES or ndim > MAX_NDIM:
            raise LayoutDecodeError(f"field {name!r} has dtype code {code} and {ndim} dimensions")
        dtype, size = DTYPES[code]
        shape = row[3 : 3 + ndim]
        end = offset + size * math.prod(shape)
        if end > nbytes:
            raise LayoutDecodeError(
                f"field {name!r} ({dtype}{list(shape)} at offset {offset}) reaches past the "
                f"layout's {nbytes} bytes"
            )
        if offset % LAYOUT_ALIGNMENT or (shape and max(shape) > capacity):
            raise LayoutDecodeError(
                f"field {name!r} ({dtype}{list(shape)} at offset {offset}) cannot be viewed: "
                f"offsets are multiples of {LAYOUT_ALIGNMENT} and no dimension exceeds the "
                f"slot's {capacity} bytes"
            )
        dtypes.append(dtype)
        shapes.append(shape)
        offsets.append(offset)
        if end > offset:
            spans.append((offset, end, name))
    _check_disjoint(strings[:n_fields], spans)
    # the consumer decodes every micro-batch right after waking: no __init__ frame per field
    fields = build_many(FieldView, n_fields, strings, dtypes, shapes, offsets)
    cu = struct.unpack_from(f"<{n_cu}q", blob, at)
    try:
        units = tuple(map(UnitKey.parse, strings[n_fields + n_traj : names]))
    except ValueError as exc:
        raise LayoutDecodeError(str(exc)) from None
    extra = {}
    at += 8 * n_cu
    for i, (kind, number, real) in enumerate(_EXTRA.iter_unpack(blob[at:tables])):
        name = strings[names + i]
        if kind == _INT:
            extra[name] = number
        elif kind == _FLOAT:
            extra[name] = real
        elif kind == _STR and names + n_extra <= number < n_strings:
            extra[name] = strings[number]
        else:
            raise LayoutDecodeError(f"extra {name!r} has kind {kind} and value {number}")
    trajectory_ids = tuple(strings[n_fields : n_fields + n_traj])
    return MicroBatchLayout(tuple(fields), nbytes, cu, trajectory_ids, units, extra)


def _check_disjoint(names: list[str], spans: list[tuple[int, int, str]]) -> None:
    """``LayoutDecodeError`` for two fields of one name or two non-empty fields over one byte."""
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise LayoutDecodeError(f"field {twice!r} appears twice")
    spans.sort()
    for (_, end, name), (start, _, following) in itertools.pairwise(spans):
        if start < end:
            raise LayoutDecodeError(f"fields {name!r} and {following!r} overlap")
