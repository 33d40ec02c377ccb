"""TrajectoryStore: atomic-unit writes, per-field updates, sliced reads and unit lifetimes over a backend."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.backends.validate import check_unit
from knitkit.storage.planning.packing import RowSpec
from knitkit.storage.planning.plan import MiniBatchPlan
from knitkit.storage.units.index import HierarchicalIndex, IndexEntry, TrajectoryRecord
from knitkit.storage.units.lifetime import ConsumerLedger
from knitkit.storage.units.payload import Trajectory
from knitkit.types import SeqRange, TrajectoryMeta, UnitKey, UnitRead


class TrajectoryStore:
    """The logical storage layer: one ``UnitBackend`` plus the hierarchical index and unit lifetimes.

    Lifetime: ``register(plan)`` counts, per unit, the consumers that will read it;
    ``consumed(minibatch_id, consumer)`` frees units no remaining consumer needs, and once the
    mini-batch's last consumer is done, everything its trajectories still hold (fields nobody
    read, multimodal units no other trajectory references). ``release`` frees trajectories that
    never enter a plan (filtered out, or left over at the end of a train batch).
    """

    def __init__(self, backend: UnitBackend) -> None:
        self.backend = backend
        self.index = HierarchicalIndex()
        self._ledger = ConsumerLedger()
        self._fields: dict[str, RowSpec] = {}
        """dtype and row shape of every field name stored so far (the plans' schema)."""

    def write(self, trajectory: Trajectory) -> TrajectoryMeta:
        """Store a trajectory as atomic units; a multimodal input already stored is referenced, not copied.

        Returns its metadata (what admission and planning take). Every unit is validated first
        (``Trajectory.units``); on any error (duplicate id, invalid name, dtype or field, backend
        failure) the store and its backend are left unchanged.
        """
        tid = trajectory.trajectory_id
        if tid in self.index:
            raise KeyError(f"trajectory {tid!r} is already stored; use update() to rewrite a field")
        units = trajectory.units()
        inputs = tuple(m.key for m in trajectory.multimodal)
        fresh_inputs = {
            k: m.data
            for k, m in zip(inputs, trajectory.multimodal, strict=True)
            if not self.index.is_input(k)
        }
        written: list[UnitKey] = []
        try:
            for key, array in (*units.items(), *fresh_inputs.items()):
                self.backend.put(key, array)
                written.append(key)
        except BaseException:
            for key in written:
                self.backend.delete(key)
            raise
        record = TrajectoryRecord(
            trajectory.meta(inputs),
            {k.field: k for k in units},
            set(trajectory.token_fields),
            inputs,
        )
        self.index.add(record)
        for key, array in units.items():
            self._learn_field(key.field, array, key.field in record.token_fields)
        return record.meta

    def entries(self, trajectory_id: str) -> tuple[IndexEntry, ...]:
        """Every unit of a stored trajectory with its spec: own fields, then multimodal inputs."""
        record = self.index.record(trajectory_id)
        per_token = record.token_fields
        out = [
            IndexEntry(trajectory_id, k, self.backend.spec(k), k.field in per_token)
            for k in record.fields.values()
        ]
        out += [
            IndexEntry(trajectory_id, k, self.backend.spec(k), False)
            for k in dict.fromkeys(record.inputs)
        ]
        return tuple(out)

    def update(self, trajectory_id: str, field: str, array: np.ndarray) -> IndexEntry:
        """Rewrite (or add) one field of a trajectory: exactly one unit is written."""
        record = self.index.record(trajectory_id)
        key = UnitKey(trajectory_id, field)
        array = check_unit(key, array)
        if field in record.fields:
            self.backend.replace(key, array)
        else:
            self.backend.put(key, array)
            record.fields[field] = key
            if array.ndim and array.shape[0] == record.meta.num_tokens:
                record.token_fields.add(field)
        self._learn_field(field, array, field in record.token_fields)
        return IndexEntry(trajectory_id, key, self.backend.spec(key), field in record.token_fields)

    def read(
        self, key: UnitKey, ranges: Sequence[SeqRange] | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Read a unit, or only ``ranges`` of it (only those bytes move)."""
        return self.backend.read(key, ranges, out=out)

    def read_into(self, read: UnitRead, out: np.ndarray) -> np.ndarray:
        """``packing.ReadInto`` over this store."""
        return self.backend.read(read.key, read.ranges, out=out)

    def read_trajectory(self, trajectory_id: str) -> dict[str, np.ndarray]:
        """Every own field of a trajectory, whole (what a sample-level reader moves)."""
        record = self.index.record(trajectory_id)
        return {name: self.backend.read(key) for name, key in record.fields.items()}

    @property
    def bytes_read(self) -> int:
        return self.backend.bytes_read

    def meta(self, trajectory_id: str) -> TrajectoryMeta:
        return self.index.record(trajectory_id).meta

    def metas(self, trajectory_ids: Iterable[str] | None = None) -> list[TrajectoryMeta]:
        """Metadata of the given trajectories (all stored ones by default), for admission and planning."""
        ids = self.index.trajectory_ids() if trajectory_ids is None else trajectory_ids
        return [self.meta(t) for t in ids]

    def schema(self, trajectory_id: str) -> dict[str, RowSpec]:
        """dtype and row shape (per-token fields) or value shape (scalars) of every field, for packing."""
        record = self.index.record(trajectory_id)
        out: dict[str, RowSpec] = {}
        for name, key in record.fields.items():
            spec = self.backend.spec(key)
            out[name] = (spec.dtype, spec.shape[1:] if name in record.token_fields else spec.shape)
        return out

    def register(self, plan: MiniBatchPlan) -> MiniBatchPlan:
        """Count the consumers of every unit the plan reads; returns the plan to deliver.

        The returned plan carries every field's dtype and row shape (``ConsumerPlan.schema``),
        so a consumer without trajectories (an idle DP rank) still gets a valid empty layout:
        submit it, not the planner's, to the reorganizers. Unknown units raise ``KeyError``, a
        trajectory planned twice or already registered ``ValueError``, before any change.
        """
        live = set(self.backend.keys())
        for consumer, reads in plan.reads_by_consumer().items():
            missing = [str(r.key) for r in reads if r.key not in live]
            if missing:
                raise KeyError(
                    f"plan {plan.minibatch_id!r}: consumer {consumer} reads unknown units {missing[:5]}"
                )
        self._ledger.register(plan)
        fields = {f for c in plan.consumers for mb in c.micro_batches for f in mb.token_fields}
        fields |= {f for c in plan.consumers for mb in c.micro_batches for f in mb.scalar_fields}
        return plan.with_schema({f: self._fields[f] for f in fields if f in self._fields})

    def consumed(self, minibatch_id: str, consumer: str) -> tuple[UnitKey, ...]:
        """One consumer (``ConsumerPlan.name`` / ``EncoderRankPlan.name``) is done; returns freed units."""
        freed = [
            k for k in self._ledger.consumed(minibatch_id, consumer) if self._free_if_unused(k)
        ]
        if self._ledger.finished(minibatch_id):
            freed += self._release(self._ledger.close(minibatch_id))
        return tuple(freed)

    def abort(self, minibatch_id: str) -> tuple[UnitKey, ...]:
        """Drop a registered mini-batch whose consumers will not finish, freeing its trajectories."""
        return tuple(self._release(self._ledger.close(minibatch_id)))

    def outstanding(self, minibatch_id: str) -> tuple[str, ...]:
        """Consumers of a registered mini-batch that have not reported ``consumed`` yet."""
        return self._ledger.outstanding(minibatch_id)

    def release(self, trajectory_ids: Iterable[str]) -> tuple[UnitKey, ...]:
        """Free trajectories outside any registered plan (filtered out, or left over)."""
        ids = list(trajectory_ids)
        for tid in ids:
            self.index.record(tid)
            planned = self._ledger.planned(tid)
            if planned is not None:
                raise ValueError(
                    f"trajectory {tid!r} is planned in mini-batch {planned!r}; "
                    "its consumers free it (consumed) or abort the mini-batch"
                )
        return tuple(self._release(ids))

    def close(self) -> None:
        self.backend.close()

    def _release(self, trajectory_ids: Iterable[str]) -> list[UnitKey]:
        # A multimodal unit is freed with the last trajectory that references it; by then no
        # consumer can need it, since encoder plans only read inputs of planned trajectories.
        freed: list[UnitKey] = []
        for tid in trajectory_ids:
            record, orphans = self.index.remove(tid)
            for key in (*record.fields.values(), *orphans):
                self.backend.delete(key)
                freed.append(key)
        return freed

    def _learn_field(self, name: str, array: np.ndarray, per_token: bool) -> None:
        """Remember a field's dtype and row (or value) shape from the first unit stored for it."""
        if name not in self._fields:
            shape = tuple(int(n) for n in array.shape)
            self._fields[name] = (array.dtype.name, shape[1:] if per_token else shape)

    def _free_if_unused(self, key: UnitKey) -> bool:
        """Free an own field as soon as no consumer needs it (multimodal units wait for ``_release``)."""
        record = self.index.get(key.owner)
        if record is None or record.fields.get(key.field) != key:
            return False
        del record.fields[key.field]
        self.backend.delete(key)
        return True
