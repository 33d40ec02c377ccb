"""A store's index as plain data (ints, strings, lists, dicts) and back, validated field by field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.planning.packing import RowSpec
from knitkit.storage.units.index import TrajectoryRecord
from knitkit.types import MultimodalRef, TrajectoryMeta, UnitKey

STATE_VERSION = 1


class LoadedState(NamedTuple):
    """What ``TrajectoryStore.load_state_dict`` found (torch's ``missing_keys`` /
    ``unexpected_keys``, for units)."""

    missing_units: tuple[UnitKey, ...]
    """Units the state names that the backend does not hold (only with ``strict=False``)."""
    dropped_trajectories: tuple[str, ...]
    """Trajectories left out of the index because a unit of theirs is missing: re-issue them."""
    dropped_minibatches: tuple[str, ...]
    """Registered mini-batches left out because a trajectory of theirs was dropped: re-plan
    their remaining trajectories."""
    deleted_units: tuple[UnitKey, ...]
    """Units the backend held that the state does not name (written after the state was taken,
    or freed before the crash): deleted, so re-issued trajectories can be written again."""


@dataclass(slots=True)
class StoreState:
    """A decoded, validated state."""

    records: list[TrajectoryRecord]
    schema: dict[str, RowSpec]
    declared: set[str]
    unit_bytes: dict[UnitKey, int]
    minibatches: dict[str, dict[str, Any]]
    """``ConsumerLedger.state_dict`` format."""

    def units(self) -> dict[UnitKey, str]:
        """Every unit the state names, with the trajectory that names it first."""
        out: dict[UnitKey, str] = {}
        for record in self.records:
            tid = record.meta.trajectory_id
            for key in (*record.fields.values(), *record.inputs):
                out.setdefault(key, tid)
        return out


@dataclass(frozen=True, slots=True)
class StoreSnapshot:
    """A store's state copied at one instant (``TrajectoryStore.snapshot``): ``state_dict()``
    syncs the backend and encodes, without the store (writes may go on meanwhile)."""

    records: list[TrajectoryRecord]
    """Copies: later writes to the store do not change them."""
    schema: dict[str, RowSpec]
    declared: set[str]
    unit_bytes: dict[UnitKey, int]
    minibatches: dict[str, dict[str, Any]]
    backend: UnitBackend

    def state_dict(self) -> dict[str, Any]:
        """``TrajectoryStore.state_dict``'s output; on a durable backend its units are synced
        first (NOTE [ Durable shards ] in knitkit/storage/backends/disk.py)."""
        if self.backend.durable:
            self.backend.sync()
        return encode(self.records, self.schema, self.declared, self.unit_bytes, self.minibatches)


def encode(
    records: list[TrajectoryRecord],
    schema: Mapping[str, RowSpec],
    declared: set[str],
    unit_bytes: Mapping[UnitKey, int],
    minibatches: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "trajectories": [encode_record(r) for r in records],
        "schema": {name: [dtype, list(shape)] for name, (dtype, shape) in sorted(schema.items())},
        "declared": sorted(declared),
        "unit_bytes": {str(k): n for k, n in unit_bytes.items()},
        "minibatches": minibatches,
    }


def encode_record(record: TrajectoryRecord) -> dict[str, Any]:
    """One trajectory's index record as plain data (a state's entry, a placed trajectory's)."""
    meta = record.meta
    return {
        "trajectory_id": meta.trajectory_id,
        "sample_id": meta.sample_id,
        "source": meta.source,
        "rollout_step": meta.rollout_step,
        "num_tokens": meta.num_tokens,
        "min_version": meta.min_version,
        "max_version": meta.max_version,
        "accepted": meta.accepted,
        "multimodal": [
            [str(m.key), m.token_start, m.num_tokens, float(m.cost)] for m in meta.multimodal
        ],
        "fields": {name: str(key) for name, key in record.fields.items()},
        "token_fields": sorted(record.token_fields),
        "inputs": [str(k) for k in record.inputs],
        "partial": {name: [list(r) for r in ranges] for name, ranges in record.partial.items()},
    }


def decode(state: Any) -> StoreState:
    """Parse ``encode``'s output; ``ValueError`` naming the first bad entry (nothing half-loaded)."""
    try:
        return _decode(state)
    except (TypeError, ValueError) as exc:
        if str(exc).startswith("store state"):
            raise
        raise ValueError(
            f"store state: malformed ({exc}); pass what state_dict() returned"
        ) from None


def _decode(state: Any) -> StoreState:
    top = _dict(state, "state")
    if top.get("version") != STATE_VERSION:
        raise ValueError(
            f"store state version {top.get('version')!r}; this knitkit reads {STATE_VERSION}"
        )
    records = [
        decode_record(r, f"trajectories[{i}]")
        for i, r in enumerate(_list(top.get("trajectories"), "trajectories"))
    ]
    schema: dict[str, RowSpec] = {}
    for name, spec in _dict(top.get("schema"), "schema").items():
        dtype, shape = _list(spec, f"schema[{name!r}]")
        schema[_str(name, "schema")] = (
            _str(dtype, f"schema[{name!r}]"),
            tuple(_int(n, f"schema[{name!r}]") for n in _list(shape, f"schema[{name!r}]")),
        )
    declared = {_str(n, "declared") for n in _list(top.get("declared"), "declared")}
    unit_bytes = {
        _key(k, "unit_bytes"): _int(n, f"unit_bytes[{k!r}]")
        for k, n in _dict(top.get("unit_bytes"), "unit_bytes").items()
    }
    minibatches: dict[str, dict[str, Any]] = {}
    for mb, entry in _dict(top.get("minibatches"), "minibatches").items():
        where = f"minibatches[{mb!r}]"
        body = _dict(entry, where)
        consumers = {
            _str(c, where): [str(_key(k, where)) for k in _list(keys, where)]
            for c, keys in _dict(body.get("consumers"), where).items()
        }
        tids = [_str(t, where) for t in _list(body.get("trajectories"), where)]
        minibatches[_str(mb, "minibatches")] = {"consumers": consumers, "trajectories": tids}
    return StoreState(records, schema, declared, unit_bytes, minibatches)


def decode_record(raw: Any, where: str) -> TrajectoryRecord:
    """Parse ``encode_record``'s output; ``ValueError`` naming ``where`` and the bad entry."""
    r = _dict(raw, where)
    refs = []
    for m in _list(r.get("multimodal"), where):
        key, start, count, cost = _list(m, where)
        if not isinstance(cost, int | float) or isinstance(cost, bool):
            raise ValueError(f"store state {where}: cost {cost!r} is not a number")
        refs.append(MultimodalRef(_key(key, where), _int(start, where), _int(count, where), cost))
    try:
        meta = TrajectoryMeta(
            trajectory_id=_str(r.get("trajectory_id"), where),
            sample_id=_str(r.get("sample_id"), where),
            source=_str(r.get("source"), where),
            rollout_step=_int(r.get("rollout_step"), where),
            num_tokens=_int(r.get("num_tokens"), where),
            min_version=_int(r.get("min_version"), where),
            max_version=_int(r.get("max_version"), where),
            accepted=_bool(r.get("accepted"), where),
            multimodal=tuple(refs),
        )
    except ValueError as exc:
        raise ValueError(f"store state {where}: {exc}") from None
    fields = {_str(n, where): _key(k, where) for n, k in _dict(r.get("fields"), where).items()}
    partial = {
        _str(n, where): [
            (_int(a, where), _int(b, where)) for a, b in (_list(x, where) for x in _list(rs, where))
        ]
        for n, rs in _dict(r.get("partial"), where).items()
    }
    return TrajectoryRecord(
        meta,
        fields,
        {_str(n, where) for n in _list(r.get("token_fields"), where)},
        tuple(_key(k, where) for k in _list(r.get("inputs"), where)),
        partial,
    )


def _dict(value: Any, where: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"store state {where}: expected a dict, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"store state {where}: expected a list, got {type(value).__name__}")
    return list(value)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"store state {where}: {value!r} is not a string")
    return value


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"store state {where}: {value!r} is not an integer")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"store state {where}: {value!r} is not a bool")
    return value


def _key(value: Any, where: str) -> UnitKey:
    try:
        return UnitKey.parse(_str(value, where))
    except ValueError as exc:
        raise ValueError(f"store state {where}: {exc}") from None
