"""Mooncake store backend: one object per atomic unit, sequence ranges read with ``get_into_ranges``."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

from knitkit.storage import UnitSpec, check_ranges, check_replacement, destination
from knitkit.types import SeqRange, UnitKey

from .master import MasterAddress

_ERRORS = {
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
}

# NOTE [ Mooncake unit layout ]
#
# Unit `key` of namespace `ns` is two Mooncake objects: `ns/u/key` holds the raw C-order rows,
# `ns/s/key` its spec as JSON. The spec is written last and removed first, so a present spec
# means a complete unit. A range read asks `get_into_ranges` for byte fragments
# [start * row_nbytes, stop * row_nbytes) of `ns/u/key`, written back to back into the
# destination: only those bytes cross the transport. Mooncake reads only into registered memory:
# a read registers its destination for the call, unless it lies in a buffer `register`ed for
# good (a reorganizer's shared-memory ring). Objects are hard-pinned so the master never evicts a
# unit that a consumer has yet to read; `delete` forces removal past the read lease (10 s by
# default): the store deletes a unit only once every consumer has read it.
#
# The creating instance contributes `segment_bytes` of memory to the store and owns the
# namespace: `close()` removes its units and unmounts the segment. A pickled copy is a client of
# the same master and namespace contributing no memory. Specs are fetched per call, or once for a
# whole plan with `resolve()` (kept until `release()`, like `RayBackend`).


class MooncakeBackend:
    """``UnitBackend`` on a Mooncake store reached through the master at ``master``."""

    def __init__(
        self,
        master: MasterAddress,
        *,
        namespace: str | None = None,
        segment_bytes: int = 512 << 20,
        local_buffer_bytes: int = 16 << 20,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
    ) -> None:
        self.master = master
        self.namespace = namespace or f"knitkit-{uuid.uuid4().hex[:12]}"
        self.local_hostname = local_hostname
        self.protocol = protocol
        self._owner = segment_bytes > 0
        self._store = MooncakeDistributedStore()
        code = self._store.setup(
            local_hostname,
            "P2PHANDSHAKE",
            segment_bytes,
            local_buffer_bytes,
            protocol,
            "",
            master.rpc,
        )
        if code != 0:
            raise RuntimeError(
                f"Mooncake client setup against master {master.rpc} failed ({_name(code)}); "
                "is mooncake_master running there (see MooncakeMaster)?"
            )
        self._config = ReplicateConfig()
        self._config.with_hard_pin = True
        self._specs: dict[UnitKey, UnitSpec] = {}
        self._pinned: list[tuple[int, int]] = []
        self._bytes_read = 0

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        if self._store.is_exist(self._spec_key(key)) == 1:
            raise KeyError(f"unit {key} already exists; use replace() to update it")
        array = np.asarray(array, order="C")
        # upsert: rows left behind by a put that failed before its spec must not survive
        self._write(key, array, self._store.upsert_from)
        spec = json.dumps({"dtype": array.dtype.name, "shape": list(array.shape)}).encode()
        code = self._store.put(self._spec_key(key), spec, self._config)
        if code != 0:
            self._store.remove(self._data_key(key), True)
            _check(code, "put", key)

    def replace(self, key: UnitKey, array: np.ndarray) -> None:
        check_replacement(key, self.spec(key), array)
        self._write(key, np.asarray(array, order="C"), self._store.upsert_from)

    def spec(self, key: UnitKey) -> UnitSpec:
        resolved = self._specs.get(key)
        return resolved if resolved is not None else self._fetch_specs([key])[0]

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        spec = self.spec(key)
        checked = check_ranges(key, spec, ranges)
        dst = destination(key, spec, checked, out)
        rows = ((0, spec.shape[0] if spec.shape else 1),) if checked is None else checked
        row = spec.row_nbytes
        dst_offsets, src_offsets, sizes, at = [], [], [], 0
        for start, stop in rows:
            if stop > start:
                dst_offsets.append(at)
                src_offsets.append(start * row)
                sizes.append((stop - start) * row)
                at += (stop - start) * row
        if sizes:
            with self._registered(dst):
                done = self._store.get_into_ranges(
                    [dst.ctypes.data],
                    [[self._data_key(key)]],
                    [[dst_offsets]],
                    [[src_offsets]],
                    [[sizes]],
                )[0][0]
            for size, got in zip(sizes, done, strict=True):
                if got != size:
                    raise RuntimeError(
                        f"Mooncake ranged read of unit {key} moved {_name(got)} of {size} bytes; "
                        "was the unit deleted meanwhile?"
                    )
        self._bytes_read += dst.nbytes
        return dst

    def resolve(self, keys: Iterable[UnitKey]) -> None:
        """Fetch the specs of ``keys`` in one batch and keep them until ``release``."""
        wanted = [k for k in dict.fromkeys(keys) if k not in self._specs]
        if wanted:
            self._specs.update(zip(wanted, self._fetch_specs(wanted), strict=True))

    def release(self, keys: Iterable[UnitKey] | None = None) -> None:
        """Forget resolved specs (all of them by default)."""
        if keys is None:
            self._specs.clear()
        for key in keys or ():
            self._specs.pop(key, None)

    def register(self, buffer: np.ndarray) -> None:
        """Register a long-lived read destination once (reads into it then skip registration)."""
        _check(self._store.register_buffer(buffer.ctypes.data, buffer.nbytes), "register", None)
        self._pinned.append((buffer.ctypes.data, buffer.nbytes))

    def delete(self, key: UnitKey) -> None:
        self._specs.pop(key, None)
        code = self._store.remove(self._spec_key(key), True)
        if code == -704:
            raise KeyError(f"unknown unit {key}; it was never put or was already released")
        _check(code, "delete", key)
        if self._store.is_exist(self._data_key(key)) == 1:
            _check(self._store.remove(self._data_key(key), True), "delete", key)

    def keys(self) -> Iterator[UnitKey]:
        with urllib.request.urlopen(f"http://{self.master.http}/get_all_keys", timeout=10) as reply:
            names = reply.read().decode().split()
        prefix = f"{self.namespace}/s/"
        return iter([UnitKey.parse(n[len(prefix) :]) for n in names if n.startswith(prefix)])

    @property
    def bytes_read(self) -> int:
        return self._bytes_read

    def close(self) -> None:
        """Disconnect; the owning instance first removes every unit of its namespace."""
        if self._owner:
            self._store.remove_by_regex(f"^{self.namespace}/", True)
            self._owner = False
        for ptr, _ in self._pinned:
            self._store.unregister_buffer(ptr)
        self._pinned.clear()
        self._store.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_attach, (self.master, self.namespace, self.local_hostname, self.protocol))

    def _write(self, key: UnitKey, array: np.ndarray, op: Any) -> None:
        if array.nbytes == 0:
            return  # an empty unit is its spec alone; reads of it move no bytes
        with self._registered(array):
            _check(
                op(self._data_key(key), array.ctypes.data, array.nbytes, self._config), "write", key
            )

    def _fetch_specs(self, keys: list[UnitKey]) -> list[UnitSpec]:
        raw = self._store.get_batch([self._spec_key(k) for k in keys])
        specs = []
        for key, text in zip(keys, raw, strict=True):
            if not text:
                raise KeyError(f"unknown unit {key}; it was never put or was already released")
            fields = json.loads(text)
            specs.append(UnitSpec(fields["dtype"], tuple(fields["shape"])))
        return specs

    @contextmanager
    def _registered(self, array: np.ndarray) -> Iterator[None]:
        ptr, size = array.ctypes.data, array.nbytes
        if any(base <= ptr and ptr + size <= base + n for base, n in self._pinned):
            yield
            return
        _check(self._store.register_buffer(ptr, size), "register", None)
        try:
            yield
        finally:
            self._store.unregister_buffer(ptr)

    def _data_key(self, key: UnitKey) -> str:
        return f"{self.namespace}/u/{key}"

    def _spec_key(self, key: UnitKey) -> str:
        return f"{self.namespace}/s/{key}"


def _attach(
    master: MasterAddress, namespace: str, local_hostname: str, protocol: str
) -> MooncakeBackend:
    """Unpickle a ``MooncakeBackend``: a client of the same namespace contributing no memory."""
    return MooncakeBackend(
        master,
        namespace=namespace,
        segment_bytes=0,
        local_hostname=local_hostname,
        protocol=protocol,
    )


def _name(code: int) -> str:
    return f"{code} ({_ERRORS[code]})" if code in _ERRORS else str(code)


def _check(code: int, op: str, key: UnitKey | None) -> None:
    if code != 0:
        what = f"of unit {key} " if key is not None else ""
        raise RuntimeError(
            f"Mooncake {op} {what}failed with error {_name(code)}; "
            "a full store needs a larger segment_bytes or released units"
        )
