"""TrajectoryStore: atomic-unit writes, per-field updates, sliced reads and unit lifetimes over a backend."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from knitkit.storage.backends.backend import UnitBackend, UnitSpec, check_backend
from knitkit.storage.backends.lost import UnitsLostError
from knitkit.storage.backends.ranges import check_write, paste_ranges, spec_of
from knitkit.storage.backends.validate import check_dtype, check_name, check_unit
from knitkit.storage.planning.packing import RowSpec
from knitkit.storage.planning.plan import MiniBatchPlan
from knitkit.storage.units import state as store_state
from knitkit.storage.units.coverage import cover, gaps
from knitkit.storage.units.index import HierarchicalIndex, IndexEntry, TrajectoryRecord
from knitkit.storage.units.lifetime import ConsumerLedger
from knitkit.storage.units.payload import Trajectory
from knitkit.storage.units.placement import PlacedTrajectory, unit_specs
from knitkit.storage.units.retention import DeferredDeletes
from knitkit.storage.units.state import LoadedState, StoreSnapshot
from knitkit.types import SeqRange, TrajectoryMeta, UnitKey, UnitRead


class TrajectoryStore:
    """The logical storage layer: one ``UnitBackend`` plus the hierarchical index and unit lifetimes.

    Lifetime: ``register(plan)`` counts, per unit, the consumers that will read it;
    ``consumed(minibatch_id, consumer)`` frees units no remaining consumer needs, and once the
    mini-batch's last consumer is done, everything its trajectories still hold (fields nobody
    read, multimodal units no other trajectory references). ``release`` frees trajectories that
    never enter a plan (filtered out, or left over at the end of a train batch).

    Write-back: a pass writes per-token outputs with ``write_ranges`` into fields declared with
    ``declare_field``; ``field_complete`` says when every token of a trajectory's field is in.

    Checkpoints: ``state_dict`` / ``load_state_dict`` (torch's convention) save and restore the
    index; the units stay in the backend, so only a durable backend (``SafetensorsBackend``)
    resumes after a crash. Shared memory and memory are not durable: their trajectories must be
    re-written from a durable copy or re-issued (``load_state_dict`` names the missing units).
    A store that loads no state starts fresh: its first write clears what a previous run left
    in its durable backend (NOTE [ A fresh store clears its backend ]).
    """

    def __init__(self, backend: UnitBackend) -> None:
        check_backend(backend)
        self.backend = backend
        self.index = HierarchicalIndex()
        self._ledger = ConsumerLedger()
        self._fields: dict[str, RowSpec] = {}
        """dtype and row shape of every field name stored or declared so far (the plans' schema)."""
        self._declared: set[str] = set()
        """Fields declared for write-back: a plan may name them before they are written."""
        self._unit_bytes: dict[UnitKey, int] = {}
        """Payload bytes of every unit the store holds (own fields and multimodal inputs)."""
        self._retained = DeferredDeletes()
        self._started = False
        """Whether this store took its backend's units as its own: by ``load_state_dict``, or
        by its first ``write`` (see ``_start_fresh``)."""
        self._cleared = 0
        """Units a fresh start deleted (a previous run's that no state names)."""
        self._adopted_written: Counter[str] = Counter()
        """Bytes of written-back units adopted (``adopt_written``), by where they were put."""

    def write(self, trajectory: Trajectory) -> TrajectoryMeta:
        """Store a trajectory as atomic units; a multimodal input already stored is referenced, not copied.

        Returns its metadata (what admission and planning take). Every unit is validated first
        (``Trajectory.units``); on any error (duplicate id, invalid name, dtype or field, backend
        failure) the store and its backend are left unchanged.
        """
        tid = trajectory.trajectory_id
        if tid in self.index:
            raise KeyError(f"trajectory {tid!r} is already stored; use update() to rewrite a field")
        if not self._started:
            self._start_fresh()
        units = trajectory.units()
        inputs = tuple(m.key for m in trajectory.multimodal)
        fresh_inputs = {
            k: m.data
            for k, m in zip(inputs, trajectory.multimodal, strict=True)
            if not self.index.is_input(k)
        }
        for key in units:
            if self._retained.revive(key):  # an id written again: the old state loses its unit
                self.backend.delete(key)
        written: list[UnitKey] = []
        revived: list[UnitKey] = []
        try:
            for key, array in (*units.items(), *fresh_inputs.items()):
                if key in fresh_inputs and self._retained.revive(key):
                    revived.append(
                        key
                    )  # same content, same bytes: NOTE [ Units outlive their last state ]
                    continue
                self.backend.put(key, array)
                written.append(key)
        except BaseException:
            for key in written:
                self.backend.delete(key)
            for key in revived:
                self._retained.defer(key)
            raise
        record = TrajectoryRecord(
            trajectory.meta(inputs),
            {k.field: k for k in units},
            set(trajectory.token_fields),
            inputs,
        )
        self.index.add(record)
        for key, array in (*units.items(), *fresh_inputs.items()):
            self._unit_bytes[key] = int(np.asarray(array).nbytes)
        for key, array in units.items():
            self._learn_field(key.field, spec_of(array), key.field in record.token_fields)
        return record.meta

    def adopt(self, placed: PlacedTrajectory) -> TrajectoryMeta:
        """Index a trajectory whose units a writer already put in this store's backend
        (``UnitPlacer.place``, on the writer's node): ``write`` without moving a byte of payload.

        Checks every unit the record names with one backend lookup: ``KeyError`` naming the
        units the backend lacks (never placed, freed since, or their writer died), ``ValueError``
        naming units whose stored dtype or shape differs from the record's, or per-token fields
        whose rows differ from the trajectory's tokens; nothing is indexed then. A durable
        backend is refused (``TypeError``). See NOTE [ Units stay where they are produced ].
        """
        record = placed.record
        tid = record.meta.trajectory_id
        if tid in self.index:
            raise KeyError(f"trajectory {tid!r} is already stored; use update() to rewrite a field")
        if self.backend.durable:
            raise TypeError(
                f"trajectory {tid!r}: {type(self.backend).__name__} is durable; write() its "
                "trajectories through the store (adopt is for units placed in a shared backend "
                "such as RayBackend)"
            )
        keys = placed.unit_keys()
        unknown, wrong = self._against_backend({k: placed.specs[k] for k in keys})
        if unknown:
            raise KeyError(
                f"trajectory {tid!r}: units {unknown} are not in {type(self.backend).__name__}: "
                "never placed there, freed since, or their writer process died (it owns them); "
                "place the trajectory again"
            )
        wrong += [
            f"{key} has {placed.specs[key].shape[:1]} rows for {record.meta.num_tokens} tokens"
            for name, key in record.fields.items()
            if name in record.token_fields
            and placed.specs[key].shape[:1] != (record.meta.num_tokens,)
        ]
        if wrong:
            raise ValueError(
                f"trajectory {tid!r}: units differ from its placed record: {wrong}; place it "
                "again under a new trajectory id"
            )
        if not self._started:
            self._start_fresh()
        self.index.add(
            TrajectoryRecord(
                record.meta, dict(record.fields), set(record.token_fields), record.inputs
            )
        )
        for key in keys:
            self._unit_bytes[key] = placed.specs[key].nbytes
        for name, key in record.fields.items():
            self._learn_field(name, placed.specs[key], name in record.token_fields)
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
            if self._retained.revive(key):
                self.backend.delete(key)
            self.backend.put(key, array)
            record.fields[field] = key
            if array.ndim and array.shape[0] == record.meta.num_tokens:
                record.token_fields.add(field)
        record.partial.pop(field, None)
        self._unit_bytes[key] = int(array.nbytes)
        self._learn_field(field, spec_of(array), field in record.token_fields)
        return IndexEntry(trajectory_id, key, self.backend.spec(key), field in record.token_fields)

    def declare_field(
        self, name: str, dtype: str | np.dtype, row_shape: Sequence[int] = ()
    ) -> None:
        """Declare a per-token field that passes write back (``write_ranges``): its dtype and the
        shape of one token's row (``()`` for one value per token).

        A plan may pack a declared field before any trajectory has it (``register`` accepts
        it; check ``field_complete`` before a pass reads it). Declaring again with the same spec
        does nothing; a different spec than declared or stored is a ``ValueError``.
        """
        check_name("field name", name)
        resolved = np.dtype(dtype)
        check_dtype(UnitKey("declared", name), resolved)
        spec = (resolved.name, tuple(int(n) for n in row_shape))
        known = self._fields.get(name)
        if known is not None and known != spec:
            raise ValueError(
                f"field {name!r} is {known[0]} with rows {list(known[1])} in this store; "
                f"cannot declare it {spec[0]} with rows {list(spec[1])}"
            )
        self._fields[name] = spec
        self._declared.add(name)

    def write_ranges(
        self, trajectory_id: str, field: str, ranges: Sequence[SeqRange], values: np.ndarray
    ) -> IndexEntry:
        """Write token ``ranges`` of a per-token field: ``values`` holds their rows back to back.

        The first write of a declared field creates its unit (the trajectory's length, the
        declared dtype and row shape, zeros until written); later writes move only the given
        rows, in place where the backend can (``UnitBackend.write_ranges``). Ranges must lie in
        ``[0, num_tokens]`` and not overlap (``IndexError``); ``values`` must have the declared
        dtype and row shape and exactly the ranges' rows (``ValueError``); errors name the
        trajectory and field, and nothing is written.
        """
        record = self.index.record(trajectory_id)
        spec = self._fields.get(field)
        if spec is None or (field not in self._declared and field not in record.fields):
            raise KeyError(
                f"trajectory {trajectory_id!r}: field {field!r} is not declared; call "
                "declare_field(name, dtype, row_shape) before writing it back"
            )
        if field in record.fields and field not in record.token_fields:
            raise ValueError(
                f"trajectory {trajectory_id!r}: field {field!r} is per-trajectory, not per-token; "
                "rewrite it whole with update()"
            )
        key = UnitKey(trajectory_id, field)
        values = np.asarray(values)
        length = record.meta.num_tokens
        dtype, row = spec
        checked = check_write(key, UnitSpec(dtype, (length, *row)), ranges, values)
        if field in record.fields:
            self.backend.write_ranges(key, checked, values)
        else:
            unit = np.zeros((length, *row), dtype=dtype)
            paste_ranges(unit, checked, values)
            if self._retained.revive(key):
                self.backend.delete(key)
            self.backend.put(key, unit)
            record.fields[field] = key
            record.token_fields.add(field)
            record.partial[field] = []
            self._unit_bytes[key] = int(unit.nbytes)
        if field in record.partial:
            written = cover(record.partial[field], checked)
            if gaps(written, length):
                record.partial[field] = written
            else:
                del record.partial[field]
        return IndexEntry(trajectory_id, key, UnitSpec(dtype, (length, *row)), True)

    def adopt_written(self, units: Mapping[UnitKey, UnitSpec], placed_on: str = "") -> None:
        """Index whole per-token units of declared fields that another process assembled and
        put in this store's backend (a pass's write-backs placed on the writer's node): each
        field is then complete, exactly as ``write_ranges`` leaves it after its last range,
        without a byte of payload moving here.

        Checks every unit first, with one backend lookup: ``KeyError`` naming an unknown
        trajectory or undeclared field, or units the backend lacks; ``ValueError`` naming units
        whose spec is not the field's declared dtype and row shape over the trajectory's tokens
        (as recorded or as stored), or a field the trajectory has already; nothing is indexed
        then. ``placed_on`` (where they were put: a node) counts their bytes in ``metrics``.
        """
        wrong: list[str] = []
        for key, spec in units.items():
            record = self.index.record(key.owner)
            declared = self._fields.get(key.field)
            if declared is None or key.field not in self._declared:
                raise KeyError(
                    f"trajectory {key.owner!r}: field {key.field!r} is not declared; call "
                    "declare_field(name, dtype, row_shape) before writing it back"
                )
            expected = UnitSpec(declared[0], (record.meta.num_tokens, *declared[1]))
            if key.field in record.fields:
                wrong.append(f"{key} is stored already")
            elif spec != expected:
                wrong.append(
                    f"{key} recorded {spec.dtype}{list(spec.shape)}, declared "
                    f"{expected.dtype}{list(expected.shape)}"
                )
        unknown, stored_otherwise = self._against_backend(units)
        if unknown:
            raise KeyError(
                f"written-back units {unknown} are not in {type(self.backend).__name__}: never "
                "placed there, freed since, or the process that placed them died"
            )
        wrong += stored_otherwise
        if wrong:
            raise ValueError(f"written-back units refused: {wrong}")
        for key, spec in units.items():
            record = self.index.record(key.owner)
            record.fields[key.field] = key
            record.token_fields.add(key.field)
            record.partial.pop(key.field, None)
            self._unit_bytes[key] = spec.nbytes
            self._adopted_written[placed_on] += spec.nbytes

    def _against_backend(self, recorded: Mapping[UnitKey, UnitSpec]) -> tuple[list[str], list[str]]:
        """Units placed by another process, checked with one backend lookup (``adopt``,
        ``adopt_written``): those the backend lacks, and those it stores with another spec
        than recorded (each as a message)."""
        keys = list(recorded)
        found = unit_specs(self.backend, keys)
        unknown = [str(k) for k, spec in zip(keys, found, strict=True) if spec is None]
        differ = [
            f"{k} stored {spec.dtype}{list(spec.shape)}, recorded "
            f"{recorded[k].dtype}{list(recorded[k].shape)}"
            for k, spec in zip(keys, found, strict=True)
            if spec is not None and spec != recorded[k]
        ]
        return unknown, differ

    def field_complete(self, trajectory_id: str, field: str) -> bool:
        """Whether every token of the trajectory's ``field`` has been written."""
        record = self.index.record(trajectory_id)
        return field in record.fields and field not in record.partial

    def missing_ranges(self, trajectory_id: str, field: str) -> tuple[SeqRange, ...]:
        """The token ranges of the trajectory's per-token ``field`` not written yet."""
        record = self.index.record(trajectory_id)
        if field not in record.fields:
            return ((0, record.meta.num_tokens),) if record.meta.num_tokens else ()
        if field not in record.partial:
            return ()
        return gaps(record.partial[field], record.meta.num_tokens)

    def read(
        self, key: UnitKey, ranges: Sequence[SeqRange] | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Read a unit, or only ``ranges`` of it (only those bytes move)."""
        return self.backend.read(key, ranges, out=out)

    def read_into(self, read: UnitRead, out: np.ndarray) -> np.ndarray:
        """``packing.ReadInto`` over this store (``read.columns`` too: the backend's ``read_many``)."""
        self.backend.read_many([read], [out])
        return out

    def read_trajectory(self, trajectory_id: str) -> dict[str, np.ndarray]:
        """Every own field of a trajectory, whole (what a sample-level reader moves)."""
        record = self.index.record(trajectory_id)
        return {name: self.backend.read(key) for name, key in record.fields.items()}

    @property
    def bytes_read(self) -> int:
        return self.backend.bytes_read

    def metrics(self) -> dict[str, float]:
        """Run figures (flat, ``knitkit/storage/...``, plain floats):

        - ``bytes_read``: payload bytes read through this process's backend (cumulative);
        - ``units_live``, ``bytes_live``: units the store holds (own fields and multimodal
          inputs, each once) and their payload bytes;
        - ``trajectories_live``: trajectories in the index;
        - ``minibatches_registered``: registered mini-batches not yet finished or aborted;
        - ``deletes_deferred``: durable units kept for a saved state (NOTE [ Units outlive
          their last state ] in ``retention.py``);
        - ``units_cleared``: units of a previous run a fresh start deleted from a durable
          backend (NOTE [ A fresh store clears its backend ]);
        - ``written_back_bytes_adopted``: bytes of written-back units other processes placed
          (``adopt_written``), and ``written_back_bytes_adopted_on/<where>`` per place (node);
        - the backend's own figures (``SharedMemoryBackend``: ``shm_bytes``,
          ``shm_used_bytes``, ``journal_bytes``; ``SafetensorsBackend``: ``journal_bytes``).
        """
        out = {
            "knitkit/storage/bytes_read": float(self.backend.bytes_read),
            "knitkit/storage/units_live": float(len(self._unit_bytes)),
            "knitkit/storage/bytes_live": float(sum(self._unit_bytes.values())),
            "knitkit/storage/trajectories_live": float(len(self.index)),
            "knitkit/storage/minibatches_registered": float(len(self._ledger.minibatches())),
            "knitkit/storage/deletes_deferred": float(self._retained.pending),
            "knitkit/storage/units_cleared": float(self._cleared),
        }
        out["knitkit/storage/written_back_bytes_adopted"] = float(
            sum(self._adopted_written.values())
        )
        out.update(
            {
                f"knitkit/storage/written_back_bytes_adopted_on/{where}": float(size)
                for where, size in self._adopted_written.items()
                if where
            }
        )
        out.update(self.backend.metrics())
        return out

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
        submit it, not the planner's, to the reorganizers. Raises before any change:
        ``ValueError`` naming the trajectory and field when a trajectory lacks a field the plan
        packs (a declared write-back field may still be unwritten), ``KeyError`` for unknown
        trajectories or multimodal units, ``UnitsLostError`` naming units the index holds but
        the backend lost, ``ValueError`` for a trajectory planned twice or already registered.
        """
        self._check_plan_units(plan)
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

    def state_dict(
        self,
        *,
        trajectories: Iterable[str] | None = None,
        fields: Collection[str] | None = None,
    ) -> dict[str, Any]:
        """The index as plain data (ints, strings, lists, dicts; JSON- and torch-saveable):
        every trajectory's metadata, unit keys, per-token fields and written-back ranges, the
        field schema and declarations, and every registered mini-batch's outstanding consumers.

        ``trajectories`` and ``fields`` restrict it to those trajectories (``KeyError`` naming
        one the store lacks) and to those of their fields (their multimodal inputs always); a
        restricted state holds no registered mini-batch (those plan what it may not hold). A
        job driver keeps this way just the rollout fields of the trajectories it resumes with.

        The units are not in it: the backend is flushed, and on a durable backend synced (its
        units survive a crash of the machine, NOTE [ Durable shards ]) and they stay readable
        by a store rebuilt over it (``load_state_dict``); units this state names are kept
        through later frees until two newer states were taken (NOTE [ Units outlive their last
        state ] in ``retention.py``). Save each state before taking the next. Equal to
        ``snapshot(...).state_dict()``.
        """
        return self.snapshot(trajectories=trajectories, fields=fields).state_dict()

    def snapshot(
        self,
        *,
        trajectories: Iterable[str] | None = None,
        fields: Collection[str] | None = None,
    ) -> StoreSnapshot:
        """``state_dict``'s first half, for a caller that holds a lock around the store (the
        job driver): flush the backend, copy the index (records, schema, consumers; no
        encoding) and take the state's units off later deletes. Its ``state_dict()`` syncs and
        encodes, and needs no lock: writes may go on meanwhile."""
        self.backend.flush()
        whole = trajectories is None and fields is None
        ids = self.index.trajectory_ids() if trajectories is None else list(trajectories)
        records = [_only(self.index.record(t), fields) for t in ids]
        named = (
            set(self._unit_bytes)
            if whole
            else {k for r in records for k in (*r.fields.values(), *r.inputs)}
        )
        snapshot = StoreSnapshot(
            records,
            dict(self._fields),
            set(self._declared),
            {k: n for k, n in self._unit_bytes.items() if k in named},
            self._ledger.state_dict() if whole else {},
            self.backend,
        )
        if self.backend.durable:
            for key in self._retained.taken(named):
                self.backend.delete(key)
        return snapshot

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> LoadedState:
        """Restore ``state_dict``'s index into this (empty) store over the backend holding the
        units (for a crash: a ``SafetensorsBackend`` over the same directory).

        Units the state names but the backend lacks raise ``UnitsLostError`` naming them
        (``strict=True``), or (``strict=False``) their trajectories are left out, with any
        registered mini-batch that planned them, and named in the result: re-issue those
        trajectories (shared memory and memory never survive their process, so there every
        unit is missing). Units the backend holds that the state does not name (written after
        the state was taken, or freed before the crash) are deleted and named in the result.
        """
        if len(self.index) or self._ledger.minibatches() or self._started:
            raise ValueError("load_state_dict needs an empty store; build a new TrajectoryStore")
        loaded = store_state.decode(state)
        known = {r.meta.trajectory_id for r in loaded.records}
        if len(known) != len(loaded.records):
            raise ValueError("store state: a trajectory appears twice in 'trajectories'")
        for mb, entry in loaded.minibatches.items():
            strays = sorted(set(entry["trajectories"]) - known)
            if strays:
                raise ValueError(
                    f"store state: mini-batch {mb!r} plans trajectories {strays[:5]} the state "
                    "does not hold; it is not a TrajectoryStore.state_dict()"
                )
        named = loaded.units()
        live = set(self.backend.keys())
        missing = tuple(sorted((k for k in named if k not in live), key=str))
        if missing and strict:
            durable = (
                ""
                if self.backend.durable
                else (
                    f"; {type(self.backend).__name__} is not durable, its units die with their "
                    "owner: re-write these trajectories from a durable copy or re-issue them"
                )
            )
            raise UnitsLostError(
                missing,
                f"{type(self.backend).__name__} (store state)",
                f"named by the state but not in the backend{durable}; "
                "load_state_dict(state, strict=False) leaves their trajectories out",
            )
        lost = set(missing)
        dropped = {
            r.meta.trajectory_id
            for r in loaded.records
            if any(k in lost for k in (*r.fields.values(), *r.inputs))
        }
        dropped_mbs = [
            mb
            for mb, entry in loaded.minibatches.items()
            if dropped.intersection(entry["trajectories"])
        ]
        for record in loaded.records:
            if record.meta.trajectory_id not in dropped:
                self.index.add(record)
        kept = {
            k
            for r in loaded.records
            if r.meta.trajectory_id not in dropped
            for k in (*r.fields.values(), *r.inputs)
        }
        self._ledger.load_state_dict(
            {mb: e for mb, e in loaded.minibatches.items() if mb not in dropped_mbs}
        )
        self._fields = dict(loaded.schema)
        self._declared = set(loaded.declared)
        self._unit_bytes = {k: loaded.unit_bytes.get(k, 0) for k in kept}
        deleted = sorted((k for k in live if k not in kept), key=str)
        for key in deleted:
            self.backend.delete(key)
        if self.backend.durable:
            self._retained.taken(kept)  # the checkpoint just loaded may be needed again
        self._started = True
        return LoadedState(missing, tuple(sorted(dropped)), tuple(dropped_mbs), tuple(deleted))

    def close(self) -> None:
        self.backend.close()

    def _start_fresh(self) -> None:
        """The first write of a store that loaded no state: delete every unit its durable
        backend holds (see NOTE [ A fresh store clears its backend ])."""
        # NOTE [ A fresh store clears its backend ]:
        # A durable backend over a directory a killed run left (flushed shards, no checkpoint
        # yet, or one the user chose not to load) holds units under the ids the new run writes
        # again: ``put`` refused them (``KeyError: unit t0/tokens already exists``). A fresh
        # start CLEARS them, it does not adopt them: no saved state vouches for those bytes (a
        # rollout regenerating an id may produce other contents, and adopting would serve the
        # old ones, NOTE [ Disk readers follow the owner ]), and units never written again would
        # stay on disk with nobody to free them. It is ``load_state_dict``'s rule (delete what
        # the state does not name) applied to the empty state. It runs at the first write, not
        # at construction, because only then is it known that no ``load_state_dict`` follows;
        # ``metrics()["knitkit/storage/units_cleared"]`` counts what went. Only on a durable
        # backend: the others start empty in every new process.
        self._started = True
        if not self.backend.durable:
            return
        stale = list(self.backend.keys())
        for key in stale:
            self.backend.delete(key)
        self._cleared = len(stale)

    def _check_plan_units(self, plan: MiniBatchPlan) -> None:
        """``register``'s checks of every unit the plan reads (see NOTE [ Plans read stored
        fields ])."""
        live = set(self.backend.keys())
        lost: list[UnitKey] = []
        absent: dict[str, set[str]] = {}
        for consumer, reads in plan.reads_by_consumer().items():
            for key in (r.key for r in reads):
                if key in live:
                    continue
                if self.index.is_input(key):
                    lost.append(key)
                    continue
                record = self.index.get(key.owner)
                if record is None:
                    raise KeyError(
                        f"plan {plan.minibatch_id!r}: consumer {consumer} reads unit {key}, but "
                        "no stored trajectory (or multimodal input) owns it; plan only "
                        "trajectories this store holds"
                    )
                if key.field in record.fields:
                    lost.append(key)
                elif key.field not in self._declared:
                    absent.setdefault(key.field, set()).add(key.owner)
        if absent:
            raise ValueError(self._missing_fields(plan, absent))
        if lost:
            raise UnitsLostError(
                sorted(set(lost), key=str),
                type(self.backend).__name__,
                f"plan {plan.minibatch_id!r} reads them",
            )

    def _missing_fields(self, plan: MiniBatchPlan, absent: dict[str, set[str]]) -> str:
        # NOTE [ Plans read stored fields ]: the planner sees metadata only, so it cannot know
        # which fields a trajectory holds; a plan that packs a field some of its trajectories
        # lack (rollouts with and without logprobs mixed) would otherwise fail inside a
        # reorganizer or ``pack``, mid-delivery, as an unknown unit. The store has the index, so
        # registration refuses it, naming every such field with the trajectories that lack it
        # and some that have it. A field declared for write-back is exempt: a pass produces it
        # before the pass that reads it starts.
        tids = {
            s.trajectory_id for c in plan.consumers for mb in c.micro_batches for s in mb.sequences
        }
        lines = []
        for name, lacking in sorted(absent.items()):
            having = sorted(
                t for t in tids if (r := self.index.get(t)) is not None and name in r.fields
            )
            others = f" ({len(having)} have it, e.g. {having[:3]})" if having else ""
            lines.append(
                f"field {name!r}: {len(lacking)} of {len(tids)} trajectories lack it: "
                f"{sorted(lacking)[:8]}{' ...' if len(lacking) > 8 else ''}{others}"
            )
        return (
            f"plan {plan.minibatch_id!r} packs fields some of its trajectories lack: "
            f"{'; '.join(lines)}. Write each field for every trajectory of the plan (update, or "
            "declare_field + write_ranges), leave it out of the planner's fields, or plan these "
            "trajectories apart"
        )

    def _release(self, trajectory_ids: Iterable[str]) -> list[UnitKey]:
        # A multimodal unit is freed with the last trajectory that references it; by then no
        # consumer can need it, since encoder plans only read inputs of planned trajectories.
        freed: list[UnitKey] = []
        for tid in trajectory_ids:
            record, orphans = self.index.remove(tid)
            for key in (*record.fields.values(), *orphans):
                self._delete(key)
                freed.append(key)
        return freed

    def _delete(self, key: UnitKey) -> None:
        """Free one unit; on a durable backend one a saved state names waits (NOTE [ Units
        outlive their last state ] in ``retention.py``)."""
        self._unit_bytes.pop(key, None)
        if self.backend.durable and self._retained.holds(key):
            self._retained.defer(key)
        else:
            self.backend.delete(key)

    def _learn_field(self, name: str, spec: UnitSpec, per_token: bool) -> None:
        """Remember a field's dtype and row (or value) shape from the first unit stored for it."""
        if name not in self._fields:
            self._fields[name] = (spec.dtype, spec.shape[1:] if per_token else spec.shape)

    def _free_if_unused(self, key: UnitKey) -> bool:
        """Free an own field as soon as no consumer needs it (multimodal units wait for ``_release``)."""
        record = self.index.get(key.owner)
        if record is None or record.fields.get(key.field) != key:
            return False
        del record.fields[key.field]
        record.partial.pop(key.field, None)
        self._delete(key)
        return True


def _only(record: TrajectoryRecord, fields: Collection[str] | None) -> TrajectoryRecord:
    """A copy of ``record`` with just ``fields`` (all when ``None``) and their written-back
    ranges (later writes to the record do not change it)."""
    return TrajectoryRecord(
        record.meta,
        {name: key for name, key in record.fields.items() if fields is None or name in fields},
        {name for name in record.token_fields if fields is None or name in fields},
        record.inputs,
        {
            name: list(ranges)
            for name, ranges in record.partial.items()
            if fields is None or name in fields
        },
    )
