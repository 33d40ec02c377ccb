"""The hierarchical index: sample -> trajectory ids -> unit keys (own fields and shared multimodal units)."""

from __future__ import annotations

from dataclasses import dataclass, field

from knitkit.storage.backends.backend import UnitSpec
from knitkit.types import SeqRange, TrajectoryMeta, UnitKey


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """What a write returns for each unit it stored or updated."""

    trajectory_id: str
    """The writing trajectory (for a shared multimodal unit: the trajectory that referenced it)."""
    key: UnitKey
    spec: UnitSpec
    per_token: bool
    """True for per-token fields (axis 0 is the sequence), False for scalars and multimodal units."""


@dataclass(slots=True)
class TrajectoryRecord:
    """One trajectory in the index: its metadata and its units."""

    meta: TrajectoryMeta
    fields: dict[str, UnitKey] = field(default_factory=dict)
    token_fields: set[str] = field(default_factory=set)
    inputs: tuple[UnitKey, ...] = ()
    partial: dict[str, list[SeqRange]] = field(default_factory=dict)
    """Written-back fields not yet complete: the token ranges written so far (sorted, merged)."""


class HierarchicalIndex:
    """Every unit reachable from its sample; a multimodal unit is shared by all its referrers."""

    def __init__(self) -> None:
        self._samples: dict[str, list[str]] = {}
        self._trajectories: dict[str, TrajectoryRecord] = {}
        self._referrers: dict[UnitKey, set[str]] = {}

    def __contains__(self, trajectory_id: str) -> bool:
        return trajectory_id in self._trajectories

    def __len__(self) -> int:
        return len(self._trajectories)

    def add(self, record: TrajectoryRecord) -> None:
        tid = record.meta.trajectory_id
        if tid in self._trajectories:
            raise KeyError(f"trajectory {tid!r} is already stored; update its fields instead")
        self._trajectories[tid] = record
        self._samples.setdefault(record.meta.sample_id, []).append(tid)
        for key in record.inputs:
            self._referrers.setdefault(key, set()).add(tid)

    def remove(self, trajectory_id: str) -> tuple[TrajectoryRecord, tuple[UnitKey, ...]]:
        """Drop a trajectory; returns its record and the multimodal keys nobody references now."""
        record = self.record(trajectory_id)
        del self._trajectories[trajectory_id]
        siblings = self._samples[record.meta.sample_id]
        siblings.remove(trajectory_id)
        if not siblings:
            del self._samples[record.meta.sample_id]
        orphans = []
        for key in record.inputs:
            referrers = self._referrers[key]
            referrers.discard(trajectory_id)
            if not referrers:
                del self._referrers[key]
                orphans.append(key)
        return record, tuple(orphans)

    def record(self, trajectory_id: str) -> TrajectoryRecord:
        try:
            return self._trajectories[trajectory_id]
        except KeyError:
            raise KeyError(
                f"unknown trajectory {trajectory_id!r}; it was never written or was released"
            ) from None

    def get(self, trajectory_id: str) -> TrajectoryRecord | None:
        return self._trajectories.get(trajectory_id)

    def sample(self, sample_id: str) -> tuple[str, ...]:
        """Trajectory ids of a sample (a GRPO group), in write order."""
        if sample_id not in self._samples:
            raise KeyError(f"unknown sample {sample_id!r}")
        return tuple(self._samples[sample_id])

    def units(self, trajectory_id: str) -> tuple[UnitKey, ...]:
        """Every unit a trajectory needs: its own fields, then its multimodal inputs."""
        record = self.record(trajectory_id)
        return (*record.fields.values(), *record.inputs)

    def referrers(self, key: UnitKey) -> frozenset[str]:
        """Trajectories referencing a multimodal unit."""
        return frozenset(self._referrers.get(key, ()))

    def is_input(self, key: UnitKey) -> bool:
        return key in self._referrers

    def trajectory_ids(self) -> tuple[str, ...]:
        return tuple(self._trajectories)
