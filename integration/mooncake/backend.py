"""Mooncake store backend: one object per atomic unit, sequence ranges read with ``get_into_ranges``."""

from __future__ import annotations

import itertools
import json
import socket
import urllib.request
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from mooncake.engine import TransferEngine
from mooncake.store import MooncakeDistributedStore, ReplicaStatus, ReplicateConfig

from knitkit.integration.loopback import is_loopback, resolve
from knitkit.storage import UnitBackend
from knitkit.storage.backends import (
    ReadCounter,
    UnitSpec,
    check_replacement,
    check_unit,
    copy_ranges,
    open_read,
)
from knitkit.types import SeqRange, UnitKey, UnitRead

from .master import MasterAddress

_ERRORS = {
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
}

_FRAGMENT_GAP = 256 << 10
"""Other columns' bytes per row from which a column read asks a fragment per row rather than
staging whole rows (NOTE [ Mooncake unit layout ])."""

WILDCARD_LISTENERS = (
    "two listeners on ALL interfaces, not loopback: the TCP transport's data acceptor "
    "(dual-stack '::', IPv4 included; TcpContext in upstream mooncake-transfer-engine/src/"
    "transport/tcp_transport/tcp_transport.cpp binds asio tcp::v6()) and the P2P handshake "
    "daemon ('0.0.0.0'; SocketHandShakePlugin::startDaemon in mooncake-transfer-engine/src/"
    "transfer_metadata_plugin.cpp binds INADDR_ANY). Mooncake has no address parameter or "
    "environment variable for either (MC_TCP_BIND_ADDRESS only changes the address it "
    "advertises), so knitkit cannot keep them on loopback; the data port serves reads and "
    "writes of registered memory to whoever connects"
)
"""What every Mooncake client opens whatever ``local_hostname`` it is given (checked with
mooncake-transfer-engine-non-cuda 0.3.13.post1; see integration/mooncake/README.md)."""

# NOTE [ Mooncake unit layout ]
#
# Unit `key` of namespace `ns` is two Mooncake objects: `ns/u/key` holds the raw C-order rows,
# `ns/s/key` its spec as JSON. The spec is written last and removed first, so a present spec
# means a complete unit. A range read asks `get_into_ranges` for byte fragments
# [start * row_nbytes, stop * row_nbytes) of `ns/u/key`, written back to back into the
# destination: only those bytes cross the transport; `read_many` asks for every unit of a
# micro-batch in ONE such call (one round trip, not one per unit). Mooncake reads only into
# registered memory: a read registers its destinations for the call (per allocation, the span
# they touch), unless they lie in a buffer `register`ed for good (a reorganizer's ring). Objects
# are hard-pinned so the master never evicts a unit that a consumer has yet to read; `delete`
# forces removal past the read lease (10 s by default): the store deletes a unit only once every
# consumer has read it.
#
# A read of a column range (`UnitRead.columns`, a pipeline stage's layers of routing) could ask a
# fragment per row, its columns alone, but the transfer engine moves each fragment as a request of
# its own: measured (TCP on loopback, 16,384 x 48 x 8 uint8 routing, a memory-less reader,
# in-process timing of `read_many`, best of 3 x 5), 24 of 48 layers as 16,384 fragments 570 ms, all
# 48 layers as two fragments 3.8 ms, so one fragment costs ~35 us, the time to move ~200 KB. So a
# token range is ONE fragment from its first wanted byte to its last, into a staging buffer of whole
# rows (registered for the call), and the wanted columns are copied out of it: 3.3-4.2 ms, the other
# layers of those rows crossing too (but only the asked tokens' rows, unlike Ray's whole objects);
# only rows whose other columns reach `_FRAGMENT_GAP` (256 KiB) go as a fragment per row. The
# owner's own replicas (below) are copied column by column, nothing staged; `bytes_read` counts the
# columns delivered either way.
#
# NOTE [ Mooncake same-process reads ]
#
# `get_into_ranges` into host memory always goes through the transfer engine (TCP here), even
# when the replica lies in this very process's segment: upstream `RealClient::
# get_into_ranges_internal` (mooncake-store/src/real_client.cpp) takes its memcpy path only for
# device destinations, and `batch_get_into_multi_buffer_ranges` submits a transport scatter
# too. Mooncake's LOCAL_MEMCPY (`TransferSubmitter::canUseLocalMemcpy`, transfer_task.cpp)
# serves whole objects only, and only when the replica's transport endpoint is this process's
# own (same host is not enough: another process's addresses are not ours). So an owner does
# what LOCAL_MEMCPY does, for ranges: one `batch_get_replica_desc` per `read_many` (the master
# query a Mooncake read makes, which also takes the read lease), and for every unit whose
# complete memory replica has this client's endpoint (`host:handshake port` of the engine this
# backend creates) and the unit's exact size, a copy of the asked rows straight out of the
# segment at the replica's address. The other units go through `get_into_ranges` as before.
# A memory-less client (a pickled copy, a reader on another host) has no segment and skips the
# query. The copy is safe against eviction for the same reason as a transport read: units are
# hard-pinned and deleted only after every consumer has read them.
#
# The creating instance contributes `segment_bytes` of memory to the store and owns the
# namespace: `close()` removes its units and unmounts the segment. A pickled copy is a client of
# the same master and namespace contributing no memory. Specs are fetched per call, or once for a
# whole plan with `resolve()` (kept until `release()`, like `RayBackend`).


class MooncakeBackend(UnitBackend):
    """``UnitBackend`` on a Mooncake store reached through the master at ``master``.

    Mooncake's client listens on all interfaces whatever address it is given (see
    ``WILDCARD_LISTENERS``), so the single-node default (a loopback ``local_hostname``) starts
    only with ``allow_wildcard_listeners=True``; a non-loopback ``local_hostname`` is the
    explicit multi-node address and needs no opt-in. Loopback is decided on the addresses
    ``local_hostname`` resolves to, however it is spelled (NOTE [ Loopback by resolution ] in
    ``integration/loopback.py``); a name that does not resolve is a ``ValueError``.
    """

    def __init__(
        self,
        master: MasterAddress,
        *,
        namespace: str | None = None,
        segment_bytes: int = 512 << 20,
        local_buffer_bytes: int = 16 << 20,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        allow_wildcard_listeners: bool = False,
    ) -> None:
        master_host = master.rpc.rpartition(":")[0]
        resolve(local_hostname)  # a name that does not resolve: an error naming it, now
        if is_loopback(local_hostname) and not is_loopback(master_host):
            raise ValueError(
                f"master {master.rpc} is on another host but local_hostname={local_hostname!r} "
                "is loopback; pass local_hostname=<this node's address> for multi-node use"
            )
        if is_loopback(local_hostname) and not allow_wildcard_listeners:
            raise ValueError(
                f"MooncakeBackend(local_hostname={local_hostname!r}) would still open "
                f"{WILDCARD_LISTENERS}. Behind a firewall or in a network namespace of its own, "
                "pass allow_wildcard_listeners=True; for multi-node use pass "
                "local_hostname=<this node's address>, where listening on the network is the "
                "intent (integration/mooncake/README.md, 'Listeners')."
            )
        self._start(
            _Client.connect(master, segment_bytes, local_buffer_bytes, local_hostname, protocol),
            master,
            namespace or _fresh_namespace(),
            allow_wildcard_listeners,
        )

    def _start(
        self,
        client: _Client,
        master: MasterAddress,
        namespace: str,
        allow_wildcard_listeners: bool,
    ) -> None:
        """Serve ``namespace`` through ``client`` (one more backend on it)."""
        client.backends += 1
        self._closed = False
        self.master = master
        self.namespace = namespace
        self.local_hostname = client.local_hostname
        self.protocol = client.protocol
        self.allow_wildcard_listeners = allow_wildcard_listeners
        self._client = client
        self._store = client.store
        self._owner = client.owner
        """Whether ``close`` removes the namespace's units (a client that contributes memory)."""
        self._config = ReplicateConfig()
        self._config.with_hard_pin = True
        self._specs: dict[UnitKey, UnitSpec] = {}
        self._pinned: list[tuple[int, int]] = []
        self._reads = ReadCounter()
        self._local_bytes = 0

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        array = np.asarray(check_unit(key, array), order="C")
        if self._store.is_exist(self._spec_key(key)) == 1:
            raise KeyError(f"unit {key} already exists; use replace() to update it")
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
        _, dst = self._reads.open(key, self.spec(key), ranges, out)
        self.read_many([UnitRead(key, None if ranges is None else tuple(ranges))], [dst])
        return dst

    def read_many(self, reads: Sequence[UnitRead], outs: Sequence[np.ndarray]) -> None:
        """Every read in one batch: units in this client's own segment copied straight out of it,
        the rest in ONE ``get_into_ranges`` round trip (see NOTE [ Mooncake unit layout ] and
        NOTE [ Mooncake same-process reads ]); destination i gets its unit's ranges back to back."""
        if len(reads) != len(outs):
            raise ValueError(f"read_many got {len(reads)} reads but {len(outs)} outs; pair them")
        missing = [k for k in dict.fromkeys(r.key for r in reads) if k not in self._specs]
        specs = dict(zip(missing, self._fetch_specs(missing), strict=True)) if missing else {}
        local = self._local_replicas([r.key for r in reads], self._specs | specs)
        buffers: list[np.ndarray] = []
        staged: list[tuple[np.ndarray, np.ndarray]] = []  # (staged columns, destination rows)
        keys, dst_offsets, src_offsets, sizes = [], [], [], []
        moved = 0
        for unit, out in zip(reads, outs, strict=True):
            spec = self._specs.get(unit.key) or specs[unit.key]
            checked, columns, dst = open_read(unit, spec, out)
            moved += dst.nbytes
            if unit.key in local:
                copy_ranges(_view(local[unit.key], spec), checked, dst, columns)
                self._local_bytes += dst.nbytes
                continue
            if not dst.nbytes:
                continue
            rows = ((0, spec.shape[0] if spec.shape else 1),) if checked is None else checked
            target, fragments, columns_of = _transfer(spec, rows, columns, dst)
            if columns_of is not None:
                staged.append((columns_of, dst.reshape(len(dst), -1).view(np.uint8)))
            if fragments[2]:
                buffers.append(target)
                keys.append([self._data_key(unit.key)])
                dst_offsets.append([fragments[0]])
                src_offsets.append([fragments[1]])
                sizes.append([fragments[2]])
        if buffers:
            with self._registered(*buffers):
                done = self._store.get_into_ranges(
                    [dst.ctypes.data for dst in buffers], keys, dst_offsets, src_offsets, sizes
                )
            for key, want, got in zip(keys, sizes, done, strict=True):
                for size, moved_bytes in zip(want[0], got[0], strict=True):
                    if moved_bytes != size:
                        raise RuntimeError(
                            f"Mooncake ranged read of {key[0]} moved {_name(moved_bytes)} of "
                            f"{size} bytes; was the unit deleted meanwhile?"
                        )
        for columns_of, dst_rows in staged:
            dst_rows[...] = columns_of
        self._reads.bytes += moved

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
        return self._reads.bytes

    @property
    def bytes_read_locally(self) -> int:
        """Of ``bytes_read``, the bytes copied straight out of this client's own segment rather
        than moved by the transport (NOTE [ Mooncake same-process reads ])."""
        return self._local_bytes

    def with_namespace(self, namespace: str | None = None) -> MooncakeBackend:
        """Another backend on this one's client (its transfer engine, listeners and segment) for
        ``namespace`` (default: a fresh one), owned as this one's is: no second client to set up
        and close (NOTE [ Namespaces on one client ])."""
        if self._closed:
            raise RuntimeError(f"MooncakeBackend of namespace {self.namespace!r} is closed")
        other = MooncakeBackend.__new__(MooncakeBackend)
        other._start(
            self._client,
            self.master,
            namespace or _fresh_namespace(),
            self.allow_wildcard_listeners,
        )
        return other

    def close(self) -> None:
        """Disconnect; the owning instance first removes every unit of its namespace. The client
        closes with the last backend on it (NOTE [ Namespaces on one client ])."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            self._store.remove_by_regex(f"^{self.namespace}/", True)
            self._owner = False
        for ptr, _ in self._pinned:
            self._store.unregister_buffer(ptr)
        self._pinned.clear()
        self._client.release()

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _attach,
            (
                self.master,
                self.namespace,
                self.local_hostname,
                self.protocol,
                self.allow_wildcard_listeners,
            ),
        )

    def _write(self, key: UnitKey, array: np.ndarray, op: Any) -> None:
        if array.nbytes == 0:
            return  # an empty unit is its spec alone; reads of it move no bytes
        with self._registered(array):
            _check(
                op(self._data_key(key), array.ctypes.data, array.nbytes, self._config), "write", key
            )

    def _local_replicas(
        self, keys: Sequence[UnitKey], specs: dict[UnitKey, UnitSpec]
    ) -> dict[UnitKey, int]:
        """The address of every unit of ``keys`` whose complete replica lies in this client's own
        segment, with the unit's exact size (NOTE [ Mooncake same-process reads ])."""
        if not self._owner or not keys:
            return {}
        wanted = {self._data_key(k): k for k in dict.fromkeys(keys) if specs[k].nbytes}
        found: dict[UnitKey, int] = {}
        for name, replicas in self._store.batch_get_replica_desc(list(wanted)).items():
            key = wanted[name]
            for replica in replicas:
                if not replica.is_memory_replica() or replica.status != ReplicaStatus.COMPLETE:
                    continue
                buffer = replica.get_memory_descriptor().buffer_descriptor
                if (
                    buffer.transport_endpoint == self._client.endpoint
                    and buffer.size == specs[key].nbytes
                ):
                    found[key] = buffer.buffer_address
                    break
        return found

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
    def _registered(self, *arrays: np.ndarray) -> Iterator[None]:
        """Register the memory of ``arrays`` for one call: per underlying allocation, the span
        from the first to the last byte they touch, unless a ``register``ed buffer holds it."""
        spans: dict[int, tuple[int, int]] = {}
        for array in arrays:
            root = array
            while isinstance(root.base, np.ndarray):
                root = root.base
            ptr, end = array.ctypes.data, array.ctypes.data + array.nbytes
            low, high = spans.get(id(root), (ptr, end))
            spans[id(root)] = (min(low, ptr), max(high, end))
        todo = [
            (ptr, end - ptr)
            for ptr, end in spans.values()
            if not any(base <= ptr and end <= base + n for base, n in self._pinned)
        ]
        done: list[int] = []
        try:
            for ptr, size in todo:
                _check(self._store.register_buffer(ptr, size), "register", None)
                done.append(ptr)
            yield
        finally:
            for ptr in done:
                self._store.unregister_buffer(ptr)

    def _data_key(self, key: UnitKey) -> str:
        return f"{self.namespace}/u/{key}"

    def _spec_key(self, key: UnitKey) -> str:
        return f"{self.namespace}/s/{key}"


# NOTE [ Namespaces on one client ]
#
# A Mooncake client (a transfer engine with its listeners, the store connection, the segment an
# owner contributes) costs seconds to close: 2.0 s (quiet) to 3.0 s (loaded) inside Mooncake's
# own `MooncakeDistributedStore.close()` on the 2-core dev box, with no setting that shortens
# it. Namespaces are only key prefixes, so `with_namespace` serves another one through the same
# client: one process holding several independent stores (per job, per experiment; the test
# suite, per test) pays for one client. The backends on a client share its segment
# (an owner's units of every namespace lie in it: NOTE [ Mooncake same-process reads ] holds for
# each) and count themselves on it; each `close` removes its own namespace's units (when the
# client contributes memory) and its own registered buffers, and the last one closes the client.
# A backend's pickled copy is a memory-less client of its namespace, as before.


@dataclass(slots=True)
class _Client:
    """One Mooncake client: a transfer engine of our own (so we know its endpoint: NOTE
    [ Mooncake same-process reads ]) and the store connection on it, shared by the backends
    of every namespace served through it."""

    engine: TransferEngine | None
    store: MooncakeDistributedStore
    endpoint: str
    local_hostname: str
    protocol: str
    owner: bool
    """Whether it contributes a segment (its backends own their namespaces)."""
    backends: int = 0

    @classmethod
    def connect(
        cls,
        master: MasterAddress,
        segment_bytes: int,
        local_buffer_bytes: int,
        local_hostname: str,
        protocol: str,
    ) -> _Client:
        engine = TransferEngine()
        if engine.initialize(local_hostname, "P2PHANDSHAKE", protocol, "") != 0:
            raise RuntimeError(
                f"Mooncake transfer engine on {local_hostname!r} ({protocol}) failed to start; "
                "is local_hostname an address of this host?"
            )
        store = MooncakeDistributedStore()
        code = store.setup(
            local_hostname,
            "P2PHANDSHAKE",
            segment_bytes,
            local_buffer_bytes,
            protocol,
            "",
            master.rpc,
            engine.get_engine(),
        )
        if code != 0:
            raise RuntimeError(
                f"Mooncake client setup against master {master.rpc} failed ({_name(code)}); "
                "is mooncake_master running there (see MooncakeMaster)?"
            )
        endpoint = _endpoint(local_hostname, engine.get_rpc_port())
        return cls(engine, store, endpoint, local_hostname, protocol, segment_bytes > 0)

    def release(self) -> None:
        """One backend on it closed; the last one closes the store."""
        self.backends -= 1
        if self.backends == 0:
            self.store.close()
            self.engine = None  # the store no longer uses it: let it stop its listeners


def _fresh_namespace() -> str:
    return f"knitkit-{uuid.uuid4().hex[:12]}"


def _is_here(host: str) -> bool:
    """Whether ``host`` is an address of this host (a socket can be bound to it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((resolve(host)[0], 0))
    except (OSError, ValueError):  # not an address here, or a name this host cannot resolve
        return False
    return True


def _attach(
    master: MasterAddress,
    namespace: str,
    local_hostname: str,
    protocol: str,
    allow_wildcard_listeners: bool,
) -> MooncakeBackend:
    """Unpickle a ``MooncakeBackend``: a client of the same namespace contributing no memory
    (with the creator's ``allow_wildcard_listeners``: it opens the same listeners). On another
    host than the creator's (a reorganizer on its consumers' node), whose addresses do not
    include the creator's ``local_hostname``, it listens on this host's own address instead
    (what its hostname resolves to)."""
    if not _is_here(local_hostname):
        local_hostname = socket.gethostbyname(socket.gethostname())
    return MooncakeBackend(
        master,
        namespace=namespace,
        segment_bytes=0,
        local_hostname=local_hostname,
        protocol=protocol,
        allow_wildcard_listeners=allow_wildcard_listeners,
    )


def _transfer(
    spec: UnitSpec, rows: tuple[SeqRange, ...], columns: SeqRange | None, dst: np.ndarray
) -> tuple[np.ndarray, tuple[list[int], list[int], list[int]], np.ndarray | None]:
    """What ``get_into_ranges`` fills for one read of ``rows`` (checked, ``columns`` too): the
    buffer, its fragments (destination offsets, source offsets, sizes) and, for a column read
    it stages, the view of that buffer to copy into ``dst`` (NOTE [ Mooncake unit layout ])."""
    row = spec.row_nbytes
    spans = [(start, stop - start) for start, stop in rows if stop > start]
    if columns is None or columns == (0, spec.shape[1]):
        sizes = [n * row for _, n in spans]
        starts = [start * row for start, _ in spans]
        return dst, (list(itertools.accumulate(sizes[:-1], initial=0)), starts, sizes), None
    column = row // spec.shape[1]
    width, skip = column * (columns[1] - columns[0]), column * columns[0]
    if row - width >= _FRAGMENT_GAP:  # a fragment per row: its columns alone
        tokens = np.concatenate([np.arange(start, start + n) for start, n in spans])
        at = (np.arange(len(tokens)) * width).tolist()
        return dst, (at, (tokens * row + skip).tolist(), [width] * len(tokens)), None
    staging = np.empty((sum(n for _, n in spans), row), np.uint8)
    at = list(itertools.accumulate((n * row for _, n in spans[:-1]), initial=0))
    starts = [start * row + skip for start, _ in spans]
    sizes = [n * row - (row - width) for _, n in spans]
    return staging, (at, starts, sizes), staging[:, :width]


def _endpoint(host: str, port: int) -> str:
    """The transport endpoint Mooncake names a P2P client by (an IPv6 literal in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _view(address: int, spec: UnitSpec) -> np.ndarray:
    """A read-only array of ``spec`` over a replica at ``address`` in this process's segment."""
    return np.asarray(_Memory(address, spec))


class _Memory:
    """Raw memory as numpy sees it (``__array_interface__``): no ctypes type per size."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, spec: UnitSpec) -> None:
        self.__array_interface__ = {
            "data": (address, True),
            "shape": tuple(spec.shape),
            "typestr": np.dtype(spec.dtype).str,
            "version": 3,
        }


def _name(code: int) -> str:
    return f"{code} ({_ERRORS[code]})" if code in _ERRORS else str(code)


def _check(code: int, op: str, key: UnitKey | None) -> None:
    if code != 0:
        what = f"of unit {key} " if key is not None else ""
        raise RuntimeError(
            f"Mooncake {op} {what}failed with error {_name(code)}; "
            "a full store needs a larger segment_bytes or released units"
        )
