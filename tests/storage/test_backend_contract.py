"""The ``UnitBackend`` contract, run against every registered backend (see conftest.py)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knitkit.storage.backends.backend import UnitBackend, UnitSpec
from knitkit.types import UnitKey, UnitRead

_counter = itertools.count()

_DTYPES = ["uint8", "int32", "float32", "int64", "bool", "uint16"]


@st.composite
def unit_and_ranges(draw: st.DrawFn) -> tuple[np.ndarray, list[tuple[int, int]]]:
    length = draw(st.integers(0, 40))
    trailing = draw(st.sampled_from([(), (3,), (2, 4)]))
    dtype = draw(st.sampled_from(_DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    array = (
        rng.integers(0, 250, size=(length, *trailing)) % (2 if dtype == "bool" else 250)
    ).astype(dtype)
    cuts = sorted(draw(st.lists(st.integers(0, length), max_size=8)))
    ranges = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    return array, draw(st.permutations(ranges))  # disjoint, in any order


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=unit_and_ranges())
def test_sliced_read_equals_slicing_the_whole_unit(backend: UnitBackend, case) -> None:
    """read(key, ranges) == concatenation of whole[a:b]; bytes_read grows by exactly those bytes."""
    array, ranges = case
    key = UnitKey(f"t{next(_counter)}", "routing")
    backend.put(key, array)
    before = backend.bytes_read
    got = backend.read(key, ranges)
    want = np.concatenate([array[a:b] for a, b in ranges]) if ranges else array[:0]
    assert got.dtype == array.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert backend.bytes_read - before == want.nbytes
    np.testing.assert_array_equal(backend.read(key), array)


def test_read_into_out_fills_the_given_buffer(backend: UnitBackend) -> None:
    """A read with ``out`` writes into that buffer (e.g. a shared-memory slot) and returns it."""
    key = UnitKey("t-out", "logprobs")
    array = np.arange(30, dtype=np.float32).reshape(10, 3)
    backend.put(key, array)
    dst = np.zeros((12, 3), dtype=np.float32)
    got = backend.read(key, [(0, 2), (6, 10)], out=dst[2:8])
    assert np.shares_memory(got, dst)
    np.testing.assert_array_equal(dst[2:8], np.concatenate([array[0:2], array[6:10]]))
    assert not dst[:2].any() and not dst[8:].any()
    with pytest.raises(ValueError, match="t-out/logprobs"):
        backend.read(key, [(0, 2)], out=np.zeros((3, 3), dtype=np.float32))


def test_scalar_units_are_read_whole(backend: UnitBackend) -> None:
    """A 0-d unit (a reward) reads back whole; a range on it is an IndexError naming the key."""
    key = UnitKey("t-scalar", "reward")
    backend.put(key, np.array(0.75, dtype=np.float32))
    assert backend.spec(key) == UnitSpec("float32", ())
    assert float(backend.read(key)) == 0.75
    with pytest.raises(IndexError, match="t-scalar/reward"):
        backend.read(key, [(0, 1)])


def test_replace_rewrites_one_unit_in_place(backend: UnitBackend) -> None:
    """replace() with the same dtype/shape changes that unit only."""
    a, b = UnitKey("t-r", "logprobs"), UnitKey("t-r", "tokens")
    backend.put(a, np.zeros(8, dtype=np.float32))
    backend.put(b, np.arange(8, dtype=np.int32))
    backend.replace(a, np.full(8, 2.5, dtype=np.float32))
    np.testing.assert_array_equal(backend.read(a), np.full(8, 2.5, dtype=np.float32))
    np.testing.assert_array_equal(backend.read(b), np.arange(8, dtype=np.int32))


def test_bad_inputs_name_the_key_and_leave_the_backend_unchanged(backend: UnitBackend) -> None:
    """Unknown key, out-of-bounds range, wrong dtype/shape on replace, duplicate put: clear errors."""
    key = UnitKey("t-bad", "tokens")
    original = np.arange(10, dtype=np.int32)
    backend.put(key, original)
    cases = [
        (KeyError, lambda: backend.read(UnitKey("nope", "tokens"))),
        (KeyError, lambda: backend.spec(UnitKey("nope", "tokens"))),
        (KeyError, lambda: backend.delete(UnitKey("nope", "tokens"))),
        (IndexError, lambda: backend.read(key, [(0, 11)])),
        (IndexError, lambda: backend.read(key, [(5, 3)])),
        (IndexError, lambda: backend.read(key, [(-1, 3)])),
        (IndexError, lambda: backend.read(key, [(0, 4), (3, 6)])),
        (TypeError, lambda: backend.read(key, [(0.0, 4)])),
        (TypeError, lambda: backend.read(key, [(0, 4.5)])),
        (ValueError, lambda: backend.replace(key, np.arange(10, dtype=np.int64))),
        (ValueError, lambda: backend.replace(key, np.arange(11, dtype=np.int32))),
        (KeyError, lambda: backend.put(key, np.zeros(3, dtype=np.int32))),
    ]
    for error, call in cases:
        with pytest.raises(error) as info:
            call()
        assert "t-bad/tokens" in str(info.value) or "nope/tokens" in str(info.value)
    assert sorted(backend.keys()) == [key]
    assert backend.spec(key) == UnitSpec("int32", (10,))
    np.testing.assert_array_equal(backend.read(key), original)


def test_delete_removes_the_unit(backend: UnitBackend) -> None:
    """After delete() the key is unknown and a new put under it works."""
    key = UnitKey("t-del", "tokens")
    backend.put(key, np.arange(5, dtype=np.int32))
    backend.delete(key)
    assert key not in set(backend.keys())
    with pytest.raises(KeyError, match="t-del/tokens"):
        backend.read(key)
    backend.put(key, np.arange(6, dtype=np.int32))
    assert backend.spec(key).shape == (6,)


BAD_UNITS = [
    (UnitKey("", "tokens"), np.zeros(3, np.int32), ValueError),
    (UnitKey("t-w", ""), np.zeros(3, np.int32), ValueError),
    (UnitKey("t-w", "tökens"), np.zeros(3, np.int32), ValueError),
    (UnitKey("t/w", "tokens"), np.zeros(3, np.int32), ValueError),
    (UnitKey("t-w", "tokens"), np.zeros(3, np.complex64), TypeError),
    (UnitKey("t-w", "tokens"), np.array([1, "a"], dtype=object), TypeError),
    (UnitKey("t-w", "tokens"), np.array(["ab", "c"]), TypeError),
    (UnitKey("t-w", "tokens"), np.zeros(3, dtype=[("a", "i4"), ("b", "f4")]), TypeError),
    (UnitKey("t-w", "tokens"), np.zeros(3, dtype="datetime64[s]"), TypeError),
]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_every_backend_rejects_an_invalid_unit_unchanged(
    backend: UnitBackend, tmp_path: Path
) -> None:
    """Empty or non-ASCII names, an owner with '/', and complex / object / unicode / structured /
    datetime dtypes raise at ``put`` naming the unit; nothing is stored (no shm block, no disk
    file), and later writes, reads and ``close`` work."""
    good = UnitKey("t-ok", "tokens")
    backend.put(good, np.arange(4, dtype=np.int32))
    flush = getattr(backend, "flush", None)
    if flush is not None:
        flush()
    used = getattr(backend, "used_bytes", None)
    files = _files(tmp_path)
    for key, array, error in BAD_UNITS:
        with pytest.raises(error, match=re.escape(str(key))):
            backend.put(key, array)
    assert sorted(backend.keys()) == [good]
    assert getattr(backend, "used_bytes", None) == used
    if flush is not None:
        flush()
    assert _files(tmp_path) == files
    after = UnitKey("t-after", "tokens")
    backend.put(after, np.arange(5, dtype=np.int32))
    np.testing.assert_array_equal(backend.read(after, [(1, 3)]), [1, 2])


def test_big_endian_units_read_back_their_values(backend: UnitBackend) -> None:
    """A non-native byte order is converted at the boundary, never stored with its order dropped."""
    key = UnitKey("t-be", "tokens")
    backend.put(key, np.arange(4, dtype=">i4"))
    assert backend.spec(key).dtype == "int32"
    np.testing.assert_array_equal(backend.read(key), [0, 1, 2, 3])


def test_write_ranges_rewrites_exactly_those_rows(backend: UnitBackend) -> None:
    """``write_ranges`` overwrites the given rows with ``values`` (their rows back to back) and
    nothing else, buffered or already written out; bad ranges, dtypes or shapes and unknown keys
    raise naming the key and leave the unit unchanged."""
    key = UnitKey("t-wr", "routing")
    array = np.arange(60, dtype=np.int32).reshape(20, 3)
    backend.put(key, array)
    want = array.copy()
    first = -np.arange(6, dtype=np.int32).reshape(2, 3)
    backend.write_ranges(key, [(2, 4)], first)  # a disk backend still buffers the unit here
    want[2:4] = first
    backend.flush()
    second = -np.arange(100, 115, dtype=np.int32).reshape(5, 3)
    backend.write_ranges(key, [(15, 18), (0, 2)], second)  # any order, in place on disk
    want[15:18], want[0:2] = second[:3], second[3:]
    np.testing.assert_array_equal(backend.read(key), want)
    cases = [
        (IndexError, [(18, 21)], np.zeros((3, 3), np.int32)),
        (IndexError, [(0, 4), (3, 5)], np.zeros((5, 3), np.int32)),
        (ValueError, [(0, 2)], np.zeros((2, 3), np.int64)),
        (ValueError, [(0, 2)], np.zeros((3, 3), np.int32)),
        (ValueError, [(0, 2)], np.zeros((2, 4), np.int32)),
    ]
    for error, ranges, values in cases:
        with pytest.raises(error, match="t-wr/routing"):
            backend.write_ranges(key, ranges, values)
    with pytest.raises(KeyError, match="nope/routing"):
        backend.write_ranges(UnitKey("nope", "routing"), [(0, 1)], np.zeros((1, 3), np.int32))
    np.testing.assert_array_equal(backend.read(key), want)


COLUMN_READERS = ("disk", "memory", "mooncake", "ray", "shm")
"""Backends whose ``read_many`` reads a column range (``UnitRead.columns``): a pipeline stage's
layers of ``[tokens, layers, topk]`` routing (NOTE [ One ring per pipeline stage ])."""


def test_column_reads_move_only_those_columns_or_name_the_key(
    backend: UnitBackend, request: pytest.FixtureRequest
) -> None:
    """``read_many`` of token ranges (or the whole unit) x a column range == slicing the whole
    unit, and bytes_read grows by exactly those bytes; a backend that reads no column ranges
    refuses, naming the key."""
    key = UnitKey("t-columns", "routing")
    array = np.arange(10 * 6 * 2, dtype=np.uint8).reshape(10, 6, 2)
    backend.put(key, array)
    want = np.concatenate([array[1:3, 2:5], array[6:9, 2:5]])
    out = np.zeros_like(want)
    before = backend.bytes_read
    read = UnitRead(key, ((1, 3), (6, 9)), (2, 5))
    if request.node.callspec.params["backend"] not in COLUMN_READERS:
        with pytest.raises(ValueError, match=r"t-columns/routing.*UnitRead\.columns"):
            backend.read_many([read], [out])
        return
    backend.read_many([read], [out])
    np.testing.assert_array_equal(out, want)
    assert backend.bytes_read - before == want.nbytes
    last, rows = np.zeros((10, 1, 2), np.uint8), np.zeros((2, 6, 2), np.uint8)
    backend.read_many([UnitRead(key, None, (5, 6)), UnitRead(key, ((4, 6),), (0, 6))], [last, rows])
    np.testing.assert_array_equal(last, array[:, 5:6])
    np.testing.assert_array_equal(rows, array[4:6])
    with pytest.raises(IndexError, match="t-columns/routing"):
        backend.read_many([UnitRead(key, ((0, 1),), (4, 7))], [np.zeros((1, 3, 2), np.uint8)])
