"""Admission state as plain data: the config fingerprint, trajectory rows, and checked reads of a saved state."""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from knitkit.admission import checks
from knitkit.admission.pool import COLUMNS, Rows, Unit
from knitkit.admission.recent import Generation, RecentWindow
from knitkit.admission.schedules import coefficients
from knitkit.types import MultimodalRef, TrajectoryMeta, UnitKey

if TYPE_CHECKING:
    from knitkit.admission.config import AdmissionConfig, ResolvedQuota

FORMAT = 3
"""Version of the state layout; a state of another format is refused."""

# NOTE [ Admission state ]: ``AdmissionController.state_dict()`` is plain data (ints, floats,
# strings, bools, None, lists, dicts with string keys): it round-trips through JSON, sits in a
# ``torch.distributed.checkpoint`` save beside the model's and optimizer's state (dict keys are
# fixed by the config and variable-length parts are lists, so a fresh controller's state dict
# is a valid load template), and restoring it never unpickles bytes another process wrote.
# It holds everything a decision depends on: the ready pool (each unit's sequence number, so
# oldest-first stays oldest-first), incomplete GRPO groups, the duplicate window (NOTE
# [ Duplicate window ]: what settled in the open and the previous train batch, not every id
# of the run), the counters, per-step completions and issues, and the open train batch
# (index, admitted counts, starting counts s_{i,0}, the trajectories each admitted mini-batch
# took). Trajectories are stored as columns, one list per field (``encode_metas``): a million
# pending trajectories encode and decode in one pass per column, with no per-row list, and a
# column of the wrong type is found by one C-level pass before a slow one names the row. The
# pool saves the fields a GRPO group's members share (``UNIT_COLUMNS``: prompt, source,
# rollout step) once per unit beside its sequence number, and no ``accepted`` column
# (``encode_pool``), so its groups are whole and accepted by construction, and 1M pending
# trajectories in groups of 8 take 24 MB, not 48 MB;
# a loaded pool stays columns until a unit is admitted (NOTE [ Restored pool kept as
# columns ] in pool.py).
# Resume invariant (property-tested): a controller restored from a state and fed the same
# remaining reports admits exactly what the uninterrupted one admits. Loading checks every
# field, then every invariant the running controller keeps (restore.py: ids pending once and
# never admitted or settled, whole groups of one prompt, admitted counts equal to the open
# train batch's trajectories, counters that add up, bounds and the guard, the last
# mini-batch), naming the broken one, as torch's strict load names keys: a damaged state used
# to load and then admit a trajectory twice or close a train batch short of a quota. The
# config is not saved, only its fingerprint: the caller rebuilds the controller from its own
# config, and a state from a different one (sources, quotas, batch shape, policy: schedules,
# guards, selection) is refused naming each difference; sources and quotas listed in another
# order are the same config. ``snapshot()`` takes the state as references (O(pending + the
# window)) and ``AdmissionSnapshot.state_dict()`` encodes it later, so a caller holding a lock
# around the controller (the job's driver) holds it only for the copy. A user selection
# policy or predicate that keeps its own state saves it itself; the built-in ones are
# stateless.


@dataclass(frozen=True, slots=True)
class AdmissionSnapshot:
    """A consistent copy of a controller's state (``AdmissionController.snapshot()``): taking it
    copies references, O(pending + the duplicate window), and nothing in it changes afterwards;
    ``state_dict()`` does the encoding, the slow part, without the controller (NOTE
    [ Admission state ])."""

    fingerprint: Mapping[str, Any]
    stats: dict[str, int]
    seq: int
    train_batch: int
    minibatch: int
    admitted: dict[str, int]
    starts: dict[str, float]
    ledger: list[tuple[TrajectoryMeta, ...]]
    """The trajectories of each mini-batch admitted into the open train batch."""
    open_ready: dict[str, int]
    open_completed: dict[int, int]
    completed: dict[int, int]
    issued: dict[int, int]
    newest_version: int | None
    last: tuple[int, int, tuple[TrajectoryMeta, ...]] | None
    queues: list[list[Unit]]
    """Each source's ready units, oldest first."""
    groups: list[tuple[TrajectoryMeta, ...]]
    """Incomplete GRPO groups."""
    recent: RecentWindow

    def state_dict(self) -> dict[str, Any]:
        """The snapshot as plain JSON-ready data (the layout of NOTE [ Admission state ])."""
        units = [u for queue in self.queues for u in queue]
        return {
            "format": FORMAT,
            "config": dict(self.fingerprint),
            "stats": dict(self.stats),
            "seq": self.seq,
            "train_batch": self.train_batch,
            "minibatch": self.minibatch,
            "admitted": dict(self.admitted),
            "starts": dict(self.starts),
            "open_minibatches": _blocks(self.ledger),
            "open_view": {
                "ready": dict(self.open_ready),
                "completed_by_step": pairs(self.open_completed),
            },
            "completed_by_step": pairs(self.completed),
            "issued_by_step": pairs(self.issued),
            "newest_version": self.newest_version,
            "last_minibatch": {
                "position": None if self.last is None else [self.last[0], self.last[1]],
                "trajectories": encode_metas(() if self.last is None else self.last[2]),
            },
            "pool": encode_pool(units, self.fingerprint["group_size"]),
            "open_groups": _blocks(self.groups),
            "recent": {
                "previous": _generation(self.recent.previous),
                "current": _generation(self.recent.current),
            },
        }


def _blocks(blocks: Sequence[Sequence[TrajectoryMeta]]) -> dict[str, Any]:
    """Consecutive runs of trajectories (mini-batches, groups): their sizes and one column block
    (a list of blocks would give a distributed-checkpoint template a variable set of keys)."""
    return {
        "sizes": [len(b) for b in blocks],
        "trajectories": encode_metas([t for b in blocks for t in b]),
    }


def _generation(generation: Generation) -> dict[str, list[Any]]:
    return {
        "ids": list(generation.ids),
        "discarded_groups": [[s, g, v[0], v[1]] for (s, g), v in generation.groups.items()],
    }


def describe(obj: object) -> str:
    """A stable description of a policy component: a dataclass's repr, else its type's name."""
    if dataclasses.is_dataclass(obj):
        return repr(obj)
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def fingerprint(config: AdmissionConfig, quotas: Sequence[ResolvedQuota]) -> dict[str, Any]:
    """What a saved state must agree on with the controller it is loaded into. Sources and
    quotas are listed sorted: their order changes no decision, so a config listing them in
    another order loads the state."""
    n = config.num_minibatches
    budget = config.rollout_budget
    return {
        "sources": sorted(config.sources),
        "train_batch_size": int(config.train_batch_size),
        "num_minibatches": int(n),
        "group_size": int(config.group_size),
        "quotas": sorted([q.source, q.lower, q.upper, list(q.alphas)] for q in quotas),
        "size_schedule": list(coefficients(config.size_schedule, n, name="size_schedule")),
        "enforce_quotas": bool(config.enforce_quotas),
        "guards": bool(config.guards),
        "selection": describe(config.selection),
        "predicates": [
            [p.name, describe(p), list(coefficients(p.schedule, n))] for p in config.predicates
        ],
        "max_staleness": None if config.max_staleness is None else int(config.max_staleness),
        "initial_version": int(config.initial_version),
        "rollout_budget": None
        if budget is None
        else sorted([s, int(v)] for s, v in budget.items()),
    }


def differences(saved: object, current: Mapping[str, Any]) -> list[str]:
    """Each config field where ``saved`` differs from ``current``, with both values."""
    if not isinstance(saved, Mapping):
        return [f"config={_short(saved)} is not a mapping"]
    out = []
    for key, value in current.items():
        if saved.get(key) != value:
            out.append(f"{key}: saved {_short(saved.get(key))}, this controller {_short(value)}")
    out += [f"{key}: unknown field in the saved config" for key in saved if key not in current]
    return out


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


UNIT_COLUMNS = ("sample_id", "source", "rollout_step")
"""The columns every member of a GRPO group shares: the pool saves them once per unit, so its
groups are whole by construction."""
POOL_COLUMNS = tuple(name for name in COLUMNS if name not in (*UNIT_COLUMNS, "accepted"))
"""The columns the pool saves per trajectory: it holds accepted trajectories only, so it does
not save ``accepted``."""

KINDS = {"trajectory_id": "id", "sample_id": "str", "source": "str", "rollout_step": "count",
          "num_tokens": "count", "min_version": "version", "max_version": "version",
          "accepted": "bool"}  # fmt: skip


def encode_metas(metas: Sequence[TrajectoryMeta]) -> dict[str, list[Any]]:
    """Trajectories' metadata as one column per field (NOTE [ Admission state ]); multimodal
    references are sparse: ``[[row, [[owner, field, token_start, num_tokens, cost], ...]], ...]``."""
    return _encode({name: list(map(attrgetter(name), metas)) for name in COLUMNS})


def encode_pool(units: Sequence[Unit], group_size: int) -> dict[str, Any]:
    """The pool's units, in order: their sequence numbers and the columns a GRPO group shares
    (``UNIT_COLUMNS``) one value per unit, ``POOL_COLUMNS`` per trajectory as ``encode_metas``
    lays them out. Restored units lying back to back in one block are column slices of it,
    not metadata (NOTE [ Restored pool kept as columns ])."""
    # Runs of units on one restored block (or on none), each as C-level passes over its units:
    # the block's row numbers (one slice where they lie back to back), or the units' metadata.
    runs: list[tuple[Rows, list[int] | slice] | list[TrajectoryMeta]] = []
    for rows, run in itertools.groupby(units, attrgetter("rows")):
        members = list(run)
        if rows is None:
            runs.append(
                list(itertools.chain.from_iterable(map(attrgetter("trajectories"), members)))
            )
            continue
        starts = list(map(attrgetter("start"), members))
        stops = list(map(operator.add, starts, map(attrgetter("size"), members)))
        index = list(itertools.chain.from_iterable(map(range, starts, stops)))
        whole = index == list(range(starts[0], stops[-1]))
        runs.append((rows, slice(starts[0], stops[-1]) if whole else index))

    def gather(name: str, every: int) -> list[Any]:
        k = COLUMNS.index(name)

        def part(run: tuple[Rows, list[int] | slice] | list[TrajectoryMeta]) -> Iterable[Any]:
            if isinstance(run, list):
                return map(attrgetter(name), run[::every])
            column, where = run[0].columns[k], run[1]
            if isinstance(where, slice):
                return column[where.start : where.stop : every]
            return map(column.__getitem__, where[::every])

        return list(itertools.chain.from_iterable(map(part, runs)))

    return {
        "seq": list(map(attrgetter("seq"), units)),
        **{name: gather(name, group_size) for name in UNIT_COLUMNS},
        "trajectories": _encode({name: gather(name, 1) for name in POOL_COLUMNS}),
    }


def _encode(columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
    out = {name: column for name, column in columns.items() if name != "multimodal"}
    refs = columns["multimodal"]
    out["multimodal"] = [  # compress: a C-level pass skips the rows without references
        [k, [[m.key.owner, m.key.field, m.token_start, m.num_tokens, m.cost] for m in row]]
        for k, row in itertools.compress(enumerate(refs), refs)
    ]
    return out


def decode_metas(block: object, where: str) -> list[TrajectoryMeta]:
    """Inverse of ``encode_metas``, checking every field (``decode_rows``)."""
    rows = decode_rows(block, where)
    return list(rows.metas(0, len(rows.columns[0])))


def decode_rows(block: object, where: str, shared: Mapping[str, list[Any]] | None = None) -> Rows:
    """Inverse of ``encode_metas`` as columns, checking every field (a fast pass over each
    column, then a slow one that names the first bad row); ValueError names ``where``, the
    field and the row. ``shared``: columns read (and checked) elsewhere, one value per row,
    which ``block`` does not hold (the pool's ``UNIT_COLUMNS``)."""
    if not isinstance(block, Mapping):
        raise ValueError(f"{where}: expected a mapping of trajectory columns, got {_short(block)}")
    shared = shared or {}
    columns = []
    size = None
    for name in COLUMNS:
        column = shared[name] if name in shared else block.get(name)
        if not isinstance(column, list):
            raise ValueError(f"{where}: {name}: expected a list, got {_short(column)}")
        if name != "multimodal":
            if size is not None and len(column) != size:
                raise ValueError(f"{where}: {name} has {len(column)} rows, {COLUMNS[0]} {size}")
            size = len(column)
            columns.append(
                column if name in shared else checked(column, KINDS[name], f"{where}: {name}")
            )
    extra = sorted(set(block) - set(COLUMNS).difference(shared))
    if extra:
        raise ValueError(f"{where}: unknown columns {extra}")
    multimodal: list[tuple[MultimodalRef, ...]] = [()] * (size or 0)
    for entry in block["multimodal"]:
        if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], list):
            raise ValueError(f"{where}: multimodal entry {_short(entry)}: expected [row, refs]")
        row = checks.whole(entry[0], f"{where}: multimodal row")
        if row >= len(multimodal):
            raise ValueError(f"{where}: multimodal row {row} >= {len(multimodal)} rows")
        multimodal[row] = tuple(_ref(ref, f"{where}: row {row}") for ref in entry[1])
    ids, low, high = columns[0], columns[5], columns[6]
    if not all(map(operator.le, low, high)):
        k = next(k for k, (a, b) in enumerate(zip(low, high, strict=True)) if a > b)
        raise ValueError(
            f"{where}: row {k} ({ids[k]!r}): min_version {low[k]} > max_version {high[k]}"
        )
    return Rows((*columns, multimodal))


def checked(column: list[Any], kind: str, where: str) -> list[Any]:
    """``column`` if every value is of ``kind`` (``id``, ``str``, ``bool``, ``count`` >= 0,
    ``version``; numpy integers become ints); else ValueError naming the first bad row."""
    types = set(map(type, column))  # one C-level pass: a million rows in milliseconds
    if kind in ("id", "str"):
        if types <= {str} and (kind == "str" or all(column)):
            return column
        k = next(
            k for k, v in enumerate(column) if not isinstance(v, str) or (kind == "id" and not v)
        )
        raise ValueError(f"{where}[{k}]={_short(column[k])}: expected a non-empty string")
    if kind == "bool":
        if types <= {bool}:
            return column
        k = next(k for k, v in enumerate(column) if type(v) is not bool)
        raise ValueError(f"{where}[{k}]={_short(column[k])}: expected true or false")
    minimum = 0 if kind == "count" else None
    if types <= {int} and (minimum is None or min(column, default=0) >= 0):
        return column
    return [checks.whole(v, f"{where}[{k}]", minimum=minimum) for k, v in enumerate(column)]


def _ref(ref: object, where: str) -> MultimodalRef:
    if not isinstance(ref, list) or len(ref) != 5:
        raise ValueError(f"{where}: multimodal entry {_short(ref)}: expected 5 fields")
    owner, name, start, count, cost = ref
    if not isinstance(owner, str) or not isinstance(name, str):
        raise ValueError(f"{where}: multimodal key {owner!r}/{name!r}: expected strings")
    return MultimodalRef(
        UnitKey(owner, name),
        checks.whole(start, f"{where}: token_start"),
        checks.whole(count, f"{where}: num_tokens"),
        checks.finite(cost, f"{where}: cost"),
    )


def pairs(counts: Mapping[int, int]) -> list[list[int]]:
    """A counter keyed by int as ``[[key, count], ...]`` (JSON objects only take string keys)."""
    return [[int(k), int(v)] for k, v in sorted(counts.items())]


class Reader:
    """Typed, named access to a saved state: every failure says which field is wrong."""

    def __init__(self, saved: object, where: str = "admission state") -> None:
        if not isinstance(saved, Mapping):
            raise ValueError(f"{where}: expected a mapping (a state_dict()), got {_short(saved)}")
        self.saved, self.where = saved, where

    def get(self, key: str) -> Any:
        if key not in self.saved:
            raise ValueError(f"{self.where}: missing field {key!r}")
        return self.saved[key]

    def whole(self, key: str, minimum: int | None = 0) -> int:
        return checks.whole(self.get(key), f"{self.where}: {key}", minimum=minimum)

    def optional_whole(self, key: str) -> int | None:
        return None if self.get(key) is None else self.whole(key, minimum=None)

    def entries(self, key: str, length: int | None = None) -> list[Any]:
        value = self.get(key)
        if not isinstance(value, list) or (length is not None and len(value) != length):
            size = "" if length is None else f" of {length} entries"
            raise ValueError(f"{self.where}: {key}: expected a list{size}, got {_short(value)}")
        return value

    def wholes(self, key: str, length: int) -> list[int]:
        return [
            checks.whole(v, f"{self.where}: {key}[{i}]", minimum=None)
            for i, v in enumerate(self.entries(key, length))
        ]

    def per_source(self, key: str, names: Sequence[str], *, whole: bool = True) -> dict[str, Any]:
        """A ``{name: value}`` mapping with exactly ``names`` as keys (any order), in their order."""
        value = self.get(key)
        if not isinstance(value, Mapping) or set(value) != set(names):
            raise ValueError(
                f"{self.where}: {key}: expected a mapping with keys {sorted(names)}, got "
                f"{_short(value)}"
            )
        if not whole:
            return {name: value[name] for name in names}
        return {name: checks.whole(value[name], f"{self.where}: {key}[{name!r}]") for name in names}

    def counter(self, key: str) -> Counter[int]:
        out: Counter[int] = Counter()
        for row in self.entries(key):
            if not isinstance(row, list) or len(row) != 2:
                raise ValueError(f"{self.where}: {key}: expected [key, count] pairs, got {row!r}")
            out[checks.whole(row[0], f"{self.where}: {key}")] = checks.whole(
                row[1], f"{self.where}: {key}"
            )
        return out

    def section(self, key: str) -> Reader:
        return Reader(self.get(key), f"{self.where}: {key}")
