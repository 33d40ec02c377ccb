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

import functools
import itertools
import math
import operator
import struct
from dataclasses import dataclass
from functools import reduce

import numpy as np

from knitkit.storage.backends.validate import SUPPORTED_DTYPES
from knitkit.storage.planning.plan import field_views
from knitkit.types import LAYOUT_ALIGNMENT, FieldView, MicroBatchLayout, UnitKey, slot_setters

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
_ITEM_SIZES = dict(DTYPES)
_ALIGN_UP = LAYOUT_ALIGNMENT - 1
_NUM_DTYPES = len(DTYPES)


class LayoutDecodeError(ValueError):
    """Slot metadata that is not a valid layout for its slot (corrupt or hostile bytes)."""


def encode_layout(layout: MicroBatchLayout) -> bytes:
    """``layout`` as a binary record; ``ValueError`` naming the field (or string) for a dtype
    without a code, more than ``MAX_NDIM`` dimensions, or a string holding NUL."""
    fields = bytearray()
    for view in layout.fields:
        code = _code(view.name, view.dtype, view.shape)
        shape = (*view.shape, *(0,) * (MAX_NDIM - len(view.shape)))
        fields += _FIELD.pack(view.offset, code, len(view.shape), *shape)
    return _record(layout, bytes(fields), "".join(view.name + "\0" for view in layout.fields))


class RecordTemplate:
    """Records of layouts that share their field names, dtypes and trailing dimensions (a
    ``PackTemplate``'s micro-batches): the field table is built once, and a record fills in only
    each field's offset and first dimension (NOTE [ Pack templates ] in planning/packing.py)."""

    __slots__ = ("_names", "_table")

    def __init__(
        self, names: tuple[str, ...], dtypes: tuple[str, ...], trailing: tuple[tuple[int, ...], ...]
    ) -> None:
        """``ValueError`` naming the field, as ``encode_layout`` would at publication."""
        table = np.zeros(len(names), _FIELD_ARRAY)
        for i, (name, dtype, rest) in enumerate(zip(names, dtypes, trailing, strict=True)):
            table[i]["code"] = _code(name, dtype, (0, *rest))
            table[i]["ndim"] = 1 + len(rest)
            table[i]["shape"][1 : 1 + len(rest)] = rest
        self._table = table
        self._names = "".join(name + "\0" for name in names)

    def encode(self, layout: MicroBatchLayout, offsets: list[int], lead: list[int]) -> bytes:
        """The record of ``layout`` (fields in template order at ``offsets``, first dimensions
        ``lead``): ``encode_layout(layout)``, byte for byte."""
        table = self._table.copy()
        table["offset"] = offsets
        table["shape"][:, 0] = lead
        return _record(layout, table.tobytes(), self._names)


_FIELD_ARRAY = np.dtype(
    [("offset", "<u8"), ("code", "u1"), ("ndim", "u1"), ("pad", "V6"), ("shape", "<u8", MAX_NDIM)]
)
"""``_FIELD`` as a numpy record, for field tables built a column at a time."""
assert _FIELD_ARRAY.itemsize == _FIELD.size


def _code(name: str, dtype: str, shape: tuple[int, ...]) -> int:
    code = _CODES.get(dtype)
    if code is None or len(shape) > MAX_NDIM:
        raise ValueError(
            f"field {name!r}: {dtype}{list(shape)} cannot travel through a slot ring; use one of "
            f"{[n for n, _ in DTYPES]} with at most {MAX_NDIM} dimensions (bfloat16 as uint16)"
        )
    return code


def _record(layout: MicroBatchLayout, fields: bytes, names: str) -> bytes:
    """The record around a field table ``fields`` and the fields' names (NUL-terminated)."""
    strings = [*layout.trajectory_ids, *map(str, layout.units), *layout.extra]
    n_strings = len(layout.fields) + len(strings)
    extras = bytearray()
    for name, value in layout.extra.items():
        if isinstance(value, str):
            extras += _EXTRA.pack(_STR, n_strings, 0.0)
            strings.append(value)
            n_strings += 1
        elif isinstance(value, int):  # bool included: stored as its int
            extras += _EXTRA.pack(_INT, value, 0.0)
        elif isinstance(value, float):
            extras += _EXTRA.pack(_FLOAT, 0, value)
        else:
            raise ValueError(
                f"extra {name!r} is a {type(value).__name__}; extras are int, float or str"
            )
    text = names + "".join(s + "\0" for s in strings)
    if text.count("\0") != n_strings:
        bad = next(s for s in (*(v.name for v in layout.fields), *strings) if "\0" in s)
        raise ValueError(f"{bad!r} holds NUL; names, ids and extras travel NUL-terminated")
    chars = text.encode()
    cu = layout.cu_seqlens_padded
    counts = (len(cu), len(layout.trajectory_ids), len(layout.units), len(layout.extra))
    return b"".join(
        (
            _HEADER.pack(_MAGIC, layout.nbytes, len(layout.fields), *counts, n_strings, len(chars)),
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
    fields = _fields(blob, strings, n_fields, nbytes, capacity)
    cu = struct.unpack_from(f"<{n_cu}q", blob, at)
    try:
        units = tuple(map(UnitKey.parse, strings[n_fields + n_traj : names])) if n_units else ()
    except ValueError as exc:
        raise LayoutDecodeError(str(exc)) from None
    extra: dict[str, int | float | str] = {}
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
    # MicroBatchLayout(...) without its frozen __init__: NOTE [ Hand-out objects without
    # __init__ ] in knitkit/microbatch_iter/batch.py
    layout = object.__new__(MicroBatchLayout)
    set_fields, set_nbytes, set_cu, set_ids, set_units, set_extra = slot_setters(MicroBatchLayout)
    set_fields(layout, fields)
    set_nbytes(layout, nbytes)
    set_cu(layout, cu)
    set_ids(layout, trajectory_ids)
    set_units(layout, units)
    set_extra(layout, extra)
    return layout


# NOTE [ Field sets decoded once ]: a consumer decodes a record per micro-batch right after it
# wakes up. What varies between the micro-batches of one pass is each field's offset and first
# dimension (the packed token count); names, dtypes and the other dimensions are the same for all
# (NOTE [ Pack templates ] in planning/packing.py). So the field table is read with two ``struct``
# calls, one for those static columns (the cache key, with the names and the slot's capacity) and
# one for the offsets and first dimensions; the static part is checked once per field set and
# cached (``_FieldSet``), and a micro-batch pays one pass of list arithmetic over the dynamic
# columns: every offset aligned, every dimension within the slot, every field inside the layout,
# fields in increasing order without overlap. A record that fails any of these (or lays its
# fields out of order, or has fields of no dimension) goes through the full per-field check,
# which raises naming the field or accepts it, so hostile bytes are refused exactly as before.
# transfer.py's records decode in 12 us instead of 16 us (scratch profile, thread time, 2-core
# dev box, issue 31).


@dataclass(frozen=True, slots=True)
class _FieldSet:
    """The static part of a record's fields, checked: names, dtypes, the dimensions after the
    first, and bytes per unit of the first dimension; and the fields of the shapes seen lately
    (NOTE [ Shapes decoded once ])."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    trailing: tuple[tuple[int, ...], ...]
    row_bytes: tuple[int, ...]


# NOTE [ Shapes decoded once ]: where micro-batches repeat a shape (a fixed token budget padded
# to its size, images of one size, a pass that re-reads the same micro-batches, a slot that
# carries the same shape again), the decoder hands out the very tuple of ``FieldView``s it
# decoded last time for the same field table: the record's table bytes as they travel (offsets,
# dtypes, shapes) with the slot's capacity are the key, one slice and one lookup, no ``struct``
# call and no tuple of columns hashed; the names must be equal too and the record's ``nbytes``
# must still cover its last field. A consumer's view cache recognises that tuple by identity
# (NOTE [ Reused field views ] in knitkit/microbatch_iter/batch.py), so a repeated shape costs
# no per-field work at all on the rank: no view objects, no comparisons, no torch calls. The
# tuples are immutable and checked when first decoded. The cache holds a ring's worth of shapes,
# ``_MAX_SHAPES``, and is cleared when full: packed token counts that vary per micro-batch
# (transfer.py's) make a new shape each time, which costs one lookup and one insert, and a cache
# that kept growing would make the process take page faults as it grows, each of which makes the
# next release read the page map (NOTE [ Written pages only after a fault ] in slot_ring.py):
# with 64 shapes kept, a test ring's every release read it. Keyed by the table's bytes instead
# of its unpacked columns, a repeated shape's hand-out makes 3 calls fewer
# (tests/storage/test_handout_calls.py, issue 31).

_FIELD_SETS: dict[tuple[object, ...], _FieldSet] = {}
_MAX_FIELD_SETS = 64
"""Field sets a process keeps (a job has a handful: one per pass and ring kind)."""
_SHAPES: dict[tuple[int, bytes], tuple[tuple[str, ...], tuple[FieldView, ...], int]] = {}
"""(slot capacity, a record's field table as it travels) -> the fields' names, their decoded
views and the end of the last one (NOTE [ Shapes decoded once ])."""
_MAX_SHAPES = 8
"""Shapes a process keeps: a ring's slots, each repeating one (NOTE [ Shapes decoded once ])."""


@functools.lru_cache(maxsize=_MAX_FIELD_SETS)
def _columns(count: int) -> tuple[struct.Struct, struct.Struct]:
    """Structs reading ``count`` field rows' static columns (dtype code, ndim, dimensions after
    the first) and their dynamic ones (offset, first dimension)."""
    return struct.Struct("<" + "8xBB14x40s" * count), struct.Struct("<" + "Q8xQ40x" * count)


def _fields(
    blob: bytes, strings: list[str], count: int, nbytes: int, capacity: int
) -> tuple[FieldView, ...]:
    """The record's ``count`` field views, checked against the layout's ``nbytes`` and the slot's
    ``capacity`` (NOTE [ Field sets decoded once ], NOTE [ Shapes decoded once ])."""
    if not count:
        return ()
    names = tuple(strings[:count])
    table = (capacity, blob[_HEADER.size : _HEADER.size + count * _FIELD.size])
    seen = _SHAPES.get(table)
    if seen is not None and seen[2] <= nbytes and seen[0] == names:
        return seen[1]
    static, dynamic = _columns(count)
    key = (capacity, static.unpack_from(blob, _HEADER.size), names)
    known = _FIELD_SETS.get(key)
    if known is not None:
        values = dynamic.unpack_from(blob, _HEADER.size)
        offsets, leads = values[0::2], values[1::2]
        if max(leads) <= capacity and not reduce(operator.or_, offsets) & _ALIGN_UP:
            # C-level maps: no Python bytecode per field
            ends = list(map(operator.add, offsets, map(operator.mul, known.row_bytes, leads)))
            if ends[-1] <= nbytes and all(map(operator.le, ends, offsets[1:])):
                shapes = map(operator.add, zip(leads), known.trailing)  # (lead, *trailing)
                fields = tuple(field_views(names, known.dtypes, shapes, offsets))
                if len(_SHAPES) >= _MAX_SHAPES:
                    _SHAPES.clear()
                _SHAPES[table] = (names, fields, ends[-1])
                return fields
    fields = _checked_fields(blob, strings, count, nbytes, capacity)
    if all(view.shape for view in fields):  # a field of no dimension takes the full check
        if len(_FIELD_SETS) >= _MAX_FIELD_SETS:
            _FIELD_SETS.pop(next(iter(_FIELD_SETS)))
        _FIELD_SETS[key] = _FieldSet(
            names,
            tuple(v.dtype for v in fields),
            tuple(v.shape[1:] for v in fields),
            tuple(_ITEM_SIZES[v.dtype] * math.prod(v.shape[1:]) for v in fields),
        )
    return fields


def _checked_fields(
    blob: bytes, strings: list[str], count: int, nbytes: int, capacity: int
) -> tuple[FieldView, ...]:
    """Every field of the record checked one by one; ``LayoutDecodeError`` naming the first
    field that cannot be viewed inside the layout, or two that overlap or share a name."""
    rows = list(_FIELD.iter_unpack(blob[_HEADER.size : _HEADER.size + count * _FIELD.size]))
    dtypes, shapes, offsets = [], [], []
    spans: list[tuple[int, int, str]] = []
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
    _check_disjoint(strings[:count], spans)
    return tuple(field_views(strings[:count], dtypes, shapes, offsets))


def _check_disjoint(names: list[str], spans: list[tuple[int, int, str]]) -> None:
    """``LayoutDecodeError`` for two fields of one name or two non-empty fields over one byte."""
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise LayoutDecodeError(f"field {twice!r} appears twice")
    spans.sort()
    for (_, end, name), (start, _, following) in itertools.pairwise(spans):
        if start < end:
            raise LayoutDecodeError(f"fields {name!r} and {following!r} overlap")
