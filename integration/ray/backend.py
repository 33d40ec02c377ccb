"""Ray object-store backend: atomic units are immutable plasma objects, read as zero-copy numpy views."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import ray

from knitkit.storage import UnitBackend
from knitkit.storage.backends import (
    ReadCounter,
    UnitsLostError,
    UnitSpec,
    check_replacement,
    check_unit,
    copy_read,
    spec_of,
)
from knitkit.types import SeqRange, UnitKey, UnitRead

from .pinning import pinned_to

_Boxed = list[ray.ObjectRef]
"""One object ref in a list: Ray resolves top-level ref arguments of actor calls, never nested ones."""

_Entry = tuple[_Boxed, UnitSpec, str]
"""A unit in the directory: its boxed ref, its spec and the Ray node id of the process that put it."""

# NOTE [ Ray unit directory ]
#
# A unit is one immutable object in Ray's object store, put by whichever process writes it.
# A named `UnitDirectory` actor maps unit keys to (object ref, spec) and borrows the refs, so a
# unit lives until it is deleted (or the directory dies), as long as its OWNER, the process that
# put it, lives: Ray >= 2.56 has no `ray.put(_owner=...)`, so write from a long-lived process
# (the driver or an actor), not from a short task. Every `RayBackend` naming the same directory,
# in any process of the cluster, sees the same units; pickling a backend ships only its name.
#
# `replace` puts a new object and swaps the ref in the directory (objects are immutable); the
# old object is freed once no reader holds it. Readers look a key up in the directory on every
# read, unless they `resolve()`d it: then they keep its zero-copy view until `release()`. A
# reorganizer resolves all keys of an assignment in one call when it starts it (the mini-batch
# is admitted, its units are final); a `replace` after that is not seen until it resolves again.
#
# Placement and loss. The directory actor is pinned to the node of the process that creates the
# backend (the driver, normally), so it shares the driver's fate and losing a worker node never
# takes the lookup of every unit down with it. A unit whose object is lost (its owner process or
# its node died: Ray's ObjectLostError family, e.g. OwnerDiedError naming only an object id) is
# marked lost in the directory by the reader that finds it, which raises UnitsLostError naming
# the unit keys, so a trainer can drop or regenerate exactly those trajectories; a job that
# loses a node marks every unit put from it at once (`drop_node`, called by `RayControl`), and a
# read already waiting for such a unit's object sees the mark within `LOST_CHECK_S`. The
# mark stays (it is not listed by `keys()`) until the unit is deleted or put again, so every
# later reader in any process, a reorganizer included, gets UnitsLostError too, never "never
# put"; the error pickles with its keys across Ray tasks and actors (NOTE [ Lost units reach the
# trainer ]).
#
# On the node that holds an object, `ray.get` maps it: no copy. A reader on another node makes
# Ray pull the WHOLE object to its node first (Ray transfers objects, not byte ranges); sliced
# reads then copy only the asked rows. So across nodes a reorganizer that packs half of a
# unit's rows still moves all of it over the link: with the CP ranks of a group on two nodes,
# 1.89 bytes crossed the links per consumed byte against 1.02 with both on one node, and 1.01
# through Mooncake's ranged reads with the CP ranks apart (benchmarks/cluster.py:
# knitkit_cp_split, knitkit, knitkit_mooncake_cp_split). Each backend counts what its
# reads moved, by the node that put the unit (`traffic()`): rows copied out of units ("read"),
# and the whole objects behind reads of units put on another node that were not on this node
# yet when resolved ("whole", from Ray's object locations, asked once per `resolve`). "whole"
# bounds the link bytes from above: two readers of one node resolving one unit at once both
# count it while Ray moves it once, and an object under 100 KB lives with its owner, not in a
# node's store, so it counts at every resolve. The links' own counters are the measurement
# (benchmarks/cluster.py reads them). Place reorganizers on the node of their units' writers
# (`dispatch.py`) to keep reads node-local.


LOST_CHECK_S = 1.0
"""A read waiting this long for its objects asks the directory whether they were marked lost: a
unit put from a node the job lost fails its read within about this long, not once Ray's health
checks declare the node dead (~30 s on the simulated cluster) and its owner with it."""


@ray.remote(num_cpus=0)
class UnitDirectory:
    """Named actor: unit key -> (boxed object ref, spec); holding the refs keeps the units alive."""

    def __init__(self) -> None:
        self._units: dict[str, _Entry] = {}
        self._lost: dict[str, str] = {}
        """Units whose objects were lost: why (kept until deleted or put again)."""

    def add(self, key: str, boxed: _Boxed, spec: UnitSpec, node: str) -> bool:
        if key in self._units:
            return False
        self._lost.pop(key, None)
        self._units[key] = (boxed, spec, node)
        return True

    def swap(self, key: str, boxed: _Boxed, spec: UnitSpec, node: str) -> UnitSpec | None:
        """Replace the unit's object if it has ``spec``; return the stored spec (None if unknown)."""
        stored = self._units.get(key)
        if stored is not None and stored[1] == spec:
            self._units[key] = (boxed, spec, node)
        return None if stored is None else stored[1]

    def lookup(self, keys: list[str]) -> list[_Entry | str | None]:
        """Each key's (boxed ref, spec, node); for a lost unit why it was lost; None if unknown."""
        return [self._units.get(k) or self._lost.get(k) for k in keys]

    def remove(self, key: str) -> bool:
        found = self._units.pop(key, None) is not None
        return self._lost.pop(key, None) is not None or found

    def drop(self, keys: list[str], cause: str) -> None:
        """Mark units whose objects were lost."""
        for key in keys:
            if self._units.pop(key, None) is not None:
                self._lost[key] = cause

    def drop_node(self, node: str, cause: str) -> list[str]:
        """Mark every unit put from Ray node ``node`` lost; return their keys."""
        keys = [k for k, (_, _, put_from) in self._units.items() if put_from == node]
        self.drop(keys, cause)
        return keys

    def where(self) -> str:
        """Ray node id of this directory."""
        return ray.get_runtime_context().get_node_id()

    def keys(self) -> list[str]:
        return list(self._units)


class RayBackend(UnitBackend):
    """``UnitBackend`` over Ray's object store; every instance naming one directory shares its units.

    ``RayBackend()`` creates a fresh directory (this instance owns it: ``close()`` frees every
    unit); ``RayBackend(name, create=False)`` or unpickling attaches to an existing one. Needs
    ``ray.init()`` first. See NOTE [ Ray unit directory ].
    """

    def __init__(self, name: str | None = None, *, create: bool = True) -> None:
        self.name = name or f"knitkit-units-{uuid.uuid4().hex[:12]}"
        actor_name = f"knitkit-directory/{self.name}"
        if create:
            here = pinned_to(ray.get_runtime_context().get_node_id())
            self._directory = UnitDirectory.options(  # type: ignore[attr-defined]
                name=actor_name, scheduling_strategy=here
            ).remote()
        else:
            try:
                self._directory = ray.get_actor(actor_name)
            except ValueError:
                raise KeyError(
                    f"no Ray unit directory {self.name!r}; create it with RayBackend({self.name!r})"
                ) from None
        self._owner = create
        self._node = ray.get_runtime_context().get_node_id()
        self._resolved: dict[UnitKey, tuple[np.ndarray, str]] = {}
        """Resolved units: their view and the node that put them."""
        self._reads = ReadCounter()
        self._read_from: dict[str, int] = {}
        self._whole_from: dict[str, int] = {}

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        array = np.asarray(check_unit(key, array), order="C")
        ref = ray.put(array)
        if not ray.get(self._directory.add.remote(str(key), [ref], spec_of(array), self._node)):
            raise KeyError(f"unit {key} already exists; use replace() to update it")

    def replace(self, key: UnitKey, array: np.ndarray) -> None:
        check_replacement(key, self.spec(key), array)
        array = np.asarray(array, order="C")
        ref = ray.put(array)
        stored = ray.get(self._directory.swap.remote(str(key), [ref], spec_of(array), self._node))
        if stored is None:
            raise _unknown(key)
        check_replacement(key, stored, array)  # a concurrent delete + put changed the spec
        self._resolved.pop(key, None)

    def spec(self, key: UnitKey) -> UnitSpec:
        if key in self._resolved:
            return spec_of(self._resolved[key][0])
        return self._lookup([key])[0][1]

    def specs(self, keys: Sequence[UnitKey]) -> list[UnitSpec | None]:
        """Each key's spec (``None`` if unknown) in one directory call, no payload moved;
        ``UnitsLostError`` naming lost units (``TrajectoryStore.adopt`` checks placed units so)."""
        entries = ray.get(self._directory.lookup.remote([str(k) for k in keys]))
        self._check_lost(keys, entries)
        return [None if entry is None else entry[1] for entry in entries]

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        view, source = self._view(key)
        before = self._reads.bytes
        rows = self._reads.copy_rows(key, view, ranges, out)
        self._read_from[source] = self._read_from.get(source, 0) + self._reads.bytes - before
        return rows

    def read_many(self, reads: Sequence[UnitRead], outs: Sequence[np.ndarray]) -> None:
        """``read`` for every pair; a read's ``columns`` (a pipeline stage's layers) are copied
        out of the unit's view alone (the whole object still comes to this node)."""
        if len(reads) != len(outs):
            raise ValueError(f"read_many got {len(reads)} reads but {len(outs)} outs; pair them")
        for unit, out in zip(reads, outs, strict=True):
            if unit.columns is None:
                self.read(unit.key, unit.ranges, out=out)
                continue
            view, source = self._view(unit.key)
            moved = copy_read(unit, spec_of(view), view, out).nbytes
            self._reads.bytes += moved
            self._read_from[source] = self._read_from.get(source, 0) + moved

    def view(self, key: UnitKey) -> np.ndarray:
        """Read-only zero-copy view of a whole unit (mapped from this node's object store)."""
        return self._view(key)[0]

    def resolve(self, keys: Iterable[UnitKey]) -> None:
        """Look ``keys`` up in one directory call and keep their views until ``release``."""
        wanted = [k for k in dict.fromkeys(keys) if k not in self._resolved]
        if not wanted:
            return
        entries = self._lookup(wanted)
        views = self._get(wanted, entries)
        sources = [node for _, _, node in entries]
        self._resolved.update(zip(wanted, zip(views, sources, strict=True), strict=True))

    def drop_node(self, node: str, cause: str) -> tuple[UnitKey, ...]:
        """Mark every unit put from Ray node ``node`` (by a process there: its owner) lost, in
        one directory call, and return their keys: the node died, so their objects did; later
        reads raise ``UnitsLostError`` naming them. ``RayControl`` calls it for a lost node."""
        keys = tuple(
            UnitKey.parse(k) for k in ray.get(self._directory.drop_node.remote(node, cause))
        )
        for key in keys:
            self._resolved.pop(key, None)
        return keys

    def traffic(self) -> dict[str, Any]:
        """What this instance's reads moved, by the Ray node id that put each unit (cumulative):
        ``{"node": this node, "read": {node: bytes copied out of its units}, "whole": {node:
        bytes of the whole objects behind reads of its units not yet on this node}}`` (an upper
        bound of what Ray moved: NOTE [ Ray unit directory ])."""
        return {
            "node": self._node,
            "read": dict(self._read_from),
            "whole": dict(self._whole_from),
        }

    def release(self, keys: Iterable[UnitKey] | None = None) -> None:
        """Drop resolved views (all of them by default) so their objects can be freed."""
        if keys is None:
            self._resolved.clear()
        for key in keys or ():
            self._resolved.pop(key, None)

    def delete(self, key: UnitKey) -> None:
        self._resolved.pop(key, None)
        if not ray.get(self._directory.remove.remote(str(key))):
            raise _unknown(key)

    def keys(self) -> Iterator[UnitKey]:
        return iter([UnitKey.parse(k) for k in ray.get(self._directory.keys.remote())])

    @property
    def bytes_read(self) -> int:
        return self._reads.bytes

    def close(self) -> None:
        """Drop this instance's views; the owning instance also kills the directory (and units)."""
        self._resolved.clear()
        if self._owner:
            ray.kill(self._directory)
            self._owner = False

    def __reduce__(self) -> tuple[Any, ...]:
        return (_attach, (self.name,))

    def directory_node(self) -> str:
        """Ray node id where this backend's unit directory lives."""
        return str(ray.get(self._directory.where.remote()))

    def _view(self, key: UnitKey) -> tuple[np.ndarray, str]:
        """A unit's view and the node that put it (resolved, or looked up now)."""
        resolved = self._resolved.get(key)
        if resolved is not None:
            return resolved
        entry = self._lookup([key])[0]
        return self._get([key], [entry])[0], entry[2]

    def _get(self, keys: list[UnitKey], entries: list[_Entry]) -> list[np.ndarray]:
        """``ray.get`` of the entries' objects, counting the whole objects of units put on other nodes;
        lost objects are dropped from the directory and named by key."""
        refs = [boxed[0] for boxed, _, _ in entries]
        self._count_pulls(refs, [node for _, _, node in entries])
        try:
            while True:  # a unit marked lost meanwhile (its node lost: ``drop_node``) fails now
                try:
                    return list(ray.get(refs, timeout=LOST_CHECK_S))
                except ray.exceptions.GetTimeoutError:
                    lookup = self._directory.lookup.remote([str(k) for k in keys])
                    self._check_lost(keys, ray.get(lookup))
        except ray.exceptions.ObjectLostError as error:
            lost = []
            for key, ref in zip(keys, refs, strict=True):
                try:
                    ray.get(ref)
                except ray.exceptions.ObjectLostError:
                    lost.append(key)
            lost = lost or keys
            for key in lost:
                self._resolved.pop(key, None)
            cause = f"their objects' owner process or node died ({type(error).__name__})"
            ray.get(self._directory.drop.remote([str(k) for k in lost], cause))
            raise UnitsLostError(lost, self._where, cause) from error

    def _count_pulls(self, refs: list[ray.ObjectRef], sources: list[str]) -> None:
        """Add the size of every object put on another node that is not on this one yet (Ray
        pulls it whole at ``ray.get``); a figure only, so a failed lookup counts nothing."""
        remote = [
            (ref, node) for ref, node in zip(refs, sources, strict=True) if node != self._node
        ]
        if not remote:
            return
        owners: dict[str, list[ray.ObjectRef]] = {}
        # One call per owner: Ray 2.60 aborted a reorganizer (SIGABRT, a promise set twice in
        # CoreWorker::GetLocationFromOwner) on calls naming objects of two rollout writers
        # (tests/cluster/test_control_across_nodes.py, 2 of 2 runs; 0 of 4 since).
        for ref, _ in remote:
            owners.setdefault(ref.owner_address(), []).append(ref)
        where: dict[ray.ObjectRef, Any] = {}
        try:
            for refs_of_owner in owners.values():
                where.update(
                    ray.experimental.get_object_locations(refs_of_owner, timeout_ms=10_000)
                )
        except (ray.exceptions.RayError, RuntimeError):
            return
        for ref, node in remote:
            location = where.get(ref)
            if location is not None and self._node not in location["node_ids"]:
                size = int(location["object_size"] or 0)
                self._whole_from[node] = self._whole_from.get(node, 0) + size

    def _lookup(self, keys: Sequence[UnitKey]) -> list[_Entry]:
        entries = ray.get(self._directory.lookup.remote([str(k) for k in keys]))
        self._check_lost(keys, entries)
        for key, entry in zip(keys, entries, strict=True):
            if entry is None:
                raise _unknown(key)
        return entries

    def _check_lost(self, keys: Sequence[UnitKey], entries: list[_Entry | str | None]) -> None:
        lost = [(k, e) for k, e in zip(keys, entries, strict=True) if isinstance(e, str)]
        if lost:
            raise UnitsLostError([k for k, _ in lost], self._where, lost[0][1])

    @property
    def _where(self) -> str:
        return f"Ray unit directory {self.name!r}"


def _attach(name: str) -> RayBackend:
    """Unpickle a ``RayBackend``: attach to its directory, never own it."""
    return RayBackend(name, create=False)


def _unknown(key: UnitKey) -> KeyError:
    return KeyError(f"unknown unit {key}; it was never put or was already released")
