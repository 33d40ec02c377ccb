"""Units placed by the process that produced them; a store adopts them from a data-only record."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from knitkit.storage.backends.backend import UnitBackend, UnitSpec
from knitkit.storage.backends.ranges import spec_of
from knitkit.storage.backends.validate import check_dtype, check_key
from knitkit.storage.units.index import TrajectoryRecord
from knitkit.storage.units.payload import Trajectory
from knitkit.storage.units.state import decode_record, encode_record
from knitkit.types import TrajectoryMeta, UnitKey

# NOTE [ Units stay where they are produced ]:
# ``TrajectoryStore.write`` puts every unit from the process that calls it: in a job, the
# driver, so every byte of every rollout (images, per-token routing) crossed the driver's
# node and sat in its process on the way. Placement splits the write in two. The rollout
# writer, on its own node, calls ``UnitPlacer(backend, send).place(trajectory)``: it validates the trajectory
# (``Trajectory.units``), puts its units in a backend every node shares (``RayBackend``:
# ``ray.put`` in the writer, so the objects live in the writer node's object store) and
# returns a ``PlacedTrajectory``: the index record and each unit's dtype and shape, plain
# data (``to_dict`` is JSON; no pickle of ours crosses a process), about a kilobyte whatever
# the payload. The driver's ``adopt`` (``TrajectoryStore.adopt``, ``Driver.adopt``) checks
# with ONE backend lookup (``RayBackend.specs``: one directory call, no payload moved) that
# every unit exists with the recorded spec, refusing unknown keys and mismatched specs by
# name, then indexes the record exactly as ``write`` would: same admission, planning and
# lifetimes. Reorganizers then read from the writers' nodes (NOTE [ Ray unit directory ]).
#
# Chosen over a driver that receives the payload and forwards it (its RSS and NIC carry all
# of it) and over a driver that pulls units from writers on demand (every read would hop
# through it). The price is ownership: a Ray object is owned by the process that put it
# (Ray has no ``ray.put(_owner=...)``), so the WRITER PROCESS must outlive its units. If it
# dies, every unit it placed that is not yet freed is lost: reads raise ``UnitsLostError``
# naming the units (their trajectories must be re-issued: a mini-batch planned over them
# fails as NOTE [ Lost units reach the trainer ] says); trajectories it placed but the driver
# has not adopted yet are refused by ``adopt`` (unknown units). Run writers as long-lived
# processes (an SGLang router's client loop, a Ray actor), not as short tasks.
#
# Multimodal inputs are content-addressed and shared by a GRPO group: ``place`` puts an input
# the backend lacks and takes the one it holds (same key, same bytes). An input freed between
# its placement and the adoption (the last trajectory referencing it was released meanwhile)
# is refused as unknown: place the trajectory again. Durable backends are refused: their
# units must be written by the store, whose fresh start clears stale ones (NOTE [ A fresh
# store clears its backend ]).


@dataclass(frozen=True, slots=True)
class PlacedTrajectory:
    """A trajectory whose units are in a backend: its index record and each unit's spec, no payload."""

    record: TrajectoryRecord
    """Metadata, own fields by name, per-token fields and multimodal input keys."""
    specs: Mapping[UnitKey, UnitSpec]
    """dtype and shape of every unit the record names (own fields and inputs)."""

    @property
    def meta(self) -> TrajectoryMeta:
        return self.record.meta

    def unit_keys(self) -> tuple[UnitKey, ...]:
        """Every unit the record names: own fields, then multimodal inputs."""
        return (*self.record.fields.values(), *dict.fromkeys(self.record.inputs))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (strings, ints, lists, dicts): ``json.dumps`` it to send it anywhere."""
        return {
            "trajectory": encode_record(self.record),
            "specs": {str(k): [s.dtype, list(s.shape)] for k, s in self.specs.items()},
        }

    @classmethod
    def from_dict(cls, data: Any) -> PlacedTrajectory:
        """Parse ``to_dict``'s output; ``ValueError`` naming the first bad entry."""
        try:
            if not isinstance(data, dict) or not isinstance(data.get("specs"), dict):
                raise ValueError("expected a dict with 'trajectory' and 'specs'")
            record = decode_record(data.get("trajectory"), "trajectory")
            specs = {UnitKey.parse(k): _spec(k, v) for k, v in data["specs"].items()}
            placed = cls(record, specs)
            for key in placed.unit_keys():
                check_key(key)
            missing = [str(k) for k in placed.unit_keys() if k not in specs]
            if missing:
                raise ValueError(f"units {missing} have no spec")
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"placed trajectory record: {exc}; pass what PlacedTrajectory.to_dict() returned"
            ) from None
        return placed


def _spec(key: str, raw: Any) -> UnitSpec:
    if not isinstance(raw, list) or len(raw) != 2 or not isinstance(raw[1], list):
        raise ValueError(f"spec of {key}: expected [dtype, shape], got {raw!r}")
    dtype, shape = raw
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"spec of {key}: shape {shape!r} is not a list of sizes")
    check_dtype(UnitKey.parse(key), np.dtype(dtype))
    return UnitSpec(np.dtype(dtype).name, tuple(shape))


def place(backend: UnitBackend, trajectory: Trajectory) -> PlacedTrajectory:
    """Put ``trajectory``'s units in ``backend`` from this process; return the record to adopt.

    Validates first (``Trajectory.units``' errors); an input the backend holds already is
    taken as it is (content-addressed). On any error the own units put so far are deleted. See
    NOTE [ Units stay where they are produced ].
    """
    units = trajectory.units()
    inputs = trajectory.inputs()
    written: list[UnitKey] = []
    try:
        for key, array in units.items():
            backend.put(key, array)
            written.append(key)
        for key, data in inputs.items():
            # an input another trajectory of the sample placed: same key, same bytes
            with contextlib.suppress(KeyError):
                backend.put(key, data)
    except BaseException:
        for key in written:
            backend.delete(key)
        raise
    record = TrajectoryRecord(
        trajectory.meta(tuple(m.key for m in trajectory.multimodal)),
        {k.field: k for k in units},
        set(trajectory.token_fields),
        tuple(m.key for m in trajectory.multimodal),
    )
    specs = {key: spec_of(np.asarray(a)) for key, a in (*units.items(), *inputs.items())}
    return PlacedTrajectory(record, specs)


class UnitPlacer:
    """A rollout writer's handle off the driver's node: ``place`` puts a trajectory's units in
    ``backend`` from this process and returns its record; ``write`` (a ``TrajectorySink``:
    ``RolloutWriter(UnitPlacer(backend, send))``) also hands the record to ``send``, which carries
    it to the driver's ``adopt`` (a queue, an actor call, a socket). See NOTE [ Units stay where
    they are produced ].
    """

    def __init__(
        self, backend: UnitBackend, send: Callable[[PlacedTrajectory], None] | None = None
    ) -> None:
        self.backend = backend
        self.send = send

    def place(self, trajectory: Trajectory) -> PlacedTrajectory:
        """Validate ``trajectory``, put its units and return its record (``place``)."""
        return place(self.backend, trajectory)

    def write(self, trajectory: Trajectory) -> TrajectoryMeta:
        """``place`` and hand the record to ``send``; returns the metadata."""
        if self.send is None:
            raise ValueError("UnitPlacer.write sends each record: build it with send=...")
        placed = self.place(trajectory)
        self.send(placed)
        return placed.meta


def unit_specs(backend: UnitBackend, keys: Sequence[UnitKey]) -> list[UnitSpec | None]:
    """Each key's spec in ``backend`` (``None`` where unknown), in one lookup where the backend
    has ``specs(keys)`` (``RayBackend``: one directory call), else key by key."""
    batch: Callable[[Sequence[UnitKey]], list[UnitSpec | None]] | None = getattr(
        backend, "specs", None
    )
    if batch is not None:
        return batch(keys)
    out: list[UnitSpec | None] = []
    for key in keys:
        try:
            out.append(backend.spec(key))
        except KeyError:
            out.append(None)
    return out
