"""Reading a saved admission state back: every field checked, then every invariant the controller
keeps, before anything is applied."""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from knitkit.admission import checks, state
from knitkit.admission.config import ResolvedQuota
from knitkit.admission.pool import COLUMNS, Rows, Unit
from knitkit.admission.recent import Generation, GroupKey, RecentWindow
from knitkit.types import TrajectoryMeta


@dataclass(slots=True)
class Restored:
    """A saved controller state, checked and decoded (see NOTE [ Admission state ])."""

    counters: dict[str, int]
    seq: int
    train_batch: int
    minibatch: int
    admitted: dict[str, int]
    starts: dict[str, float]
    ledger: list[tuple[TrajectoryMeta, ...]]
    """The trajectories of each mini-batch admitted into the open train batch."""
    units: list[Unit]
    """The ready pool, each source oldest first, on ``pool`` (NOTE [ Restored pool kept as
    columns ])."""
    pool: Rows
    """The pool's trajectories, checked columns."""
    groups: dict[GroupKey, list[TrajectoryMeta]]
    pending_ids: set[str]
    """The ids in the pool and in incomplete groups."""
    recent: RecentWindow
    open_ready: dict[str, int]
    open_completed: Counter[int]
    completed: Counter[int]
    issued: Counter[int]
    newest_version: int | None
    last: tuple[int, int, tuple[TrajectoryMeta, ...]] | None


@dataclass(frozen=True, slots=True)
class Shape:
    """What the invariants are checked against: the loading controller's config."""

    sources: tuple[str, ...]
    quotas: tuple[ResolvedQuota, ...]
    train_batch_size: int
    minibatch_sizes: tuple[int, ...]
    group_size: int
    guarded: bool
    enforce_quotas: bool
    max_staleness: int | None
    initial_version: int


def read_state(
    saved: Mapping[str, Any],
    fingerprint: Mapping[str, Any],
    counters: Sequence[str],
    shape: Shape,
) -> Restored:
    """Check ``saved`` against the controller's ``fingerprint``, decode it and check its
    invariants; ValueError names each config difference, or the first malformed field, or the
    first broken invariant."""
    read = state.Reader(saved)
    if read.get("format") != state.FORMAT:
        raise ValueError(
            f"admission state: format={read.get('format')!r}; this version reads {state.FORMAT}"
        )
    differ = state.differences(read.get("config"), fingerprint)
    if differ:
        raise ValueError(
            "admission state was saved under a different config (build the controller with "
            "the config it was saved with); differences: " + "; ".join(differ)
        )
    sources = shape.sources
    section = read.section("stats")
    n = len(shape.minibatch_sizes)
    restored = Restored(
        counters={name: section.whole(name) for name in counters},
        seq=read.whole("seq"),
        train_batch=read.whole("train_batch"),
        minibatch=read.whole("minibatch"),
        admitted=read.per_source("admitted", sources),
        starts={
            q.source: checks.finite(v, f"admission state: starts[{q.source!r}]")
            for q, v in zip(
                shape.quotas,
                read.per_source("starts", [q.source for q in shape.quotas], whole=False).values(),
                strict=True,
            )
        },
        ledger=[],
        units=[],
        pool=Rows(tuple([] for _ in COLUMNS)),
        groups={},
        pending_ids=set(),
        recent=RecentWindow(),
        open_ready=read.section("open_view").per_source("ready", sources),
        open_completed=read.section("open_view").counter("completed_by_step"),
        completed=read.counter("completed_by_step"),
        issued=read.counter("issued_by_step"),
        newest_version=read.optional_whole("newest_version"),
        last=_minibatch(read.section("last_minibatch")),
    )
    if restored.minibatch >= n:
        raise ValueError(
            f"admission state: minibatch={restored.minibatch}: must be < num_minibatches={n}"
        )
    ledger = _blocks(read.section("open_minibatches"))
    if len(ledger) != restored.minibatch:
        raise ValueError(
            f"admission state: open_minibatches: {len(ledger)} mini-batches, minibatch="
            f"{restored.minibatch}"
        )
    restored.ledger = [tuple(mb) for mb in ledger]
    restored.pool, restored.units = _pool(read.section("pool"), shape.group_size)
    restored.groups = _groups(read.section("open_groups"), shape.group_size)
    recent = read.section("recent")
    restored.recent = RecentWindow(
        _window(recent.section("previous"), shape.group_size),
        _window(recent.section("current"), shape.group_size),
    )
    restored.pending_ids = _check_invariants(restored, shape)
    return restored


def _pool(read: state.Reader, group_size: int) -> tuple[Rows, list[Unit]]:
    """The pool's units on its checked columns, nothing materialised (NOTE [ Restored pool kept
    as columns ]); the columns a group shares are saved once per unit, ``accepted`` not at all
    (``encode_pool``)."""
    seqs = state.checked(read.entries("seq"), "count", f"{read.where}: seq")
    g, repeat = group_size, itertools.repeat
    shared = {}
    for name in state.UNIT_COLUMNS:
        column = state.checked(
            read.entries(name, len(seqs)), state.KINDS[name], f"{read.where}: {name}"
        )
        shared[name] = (
            column
            if g == 1
            else list(itertools.chain.from_iterable(map(repeat, column, repeat(g))))
        )
    shared["accepted"] = [True] * (len(seqs) * g)
    rows = state.decode_rows(read.get("trajectories"), f"{read.where}: trajectories", shared)
    low = rows.columns[COLUMNS.index("min_version")]
    oldest = low if g == 1 else list(map(min, *(low[j::g] for j in range(g))))
    source = rows.columns[COLUMNS.index("source")]
    return rows, list(
        map(Unit, seqs, source[::g], repeat(g), oldest, repeat(rows), range(0, len(low), g))
    )


def _blocks(read: state.Reader) -> list[list[TrajectoryMeta]]:
    """Consecutive runs of trajectories: ``{"sizes": [...], "trajectories": columns}``."""
    sizes = [
        checks.whole(v, f"{read.where}: sizes[{k}]") for k, v in enumerate(read.entries("sizes"))
    ]
    metas = state.decode_metas(read.get("trajectories"), f"{read.where}: trajectories")
    if sum(sizes) != len(metas):
        raise ValueError(f"{read.where}: sizes {sizes} do not sum to the {len(metas)} trajectories")
    out, first = [], 0
    for size in sizes:
        out.append(metas[first : first + size])
        first += size
    return out


def _groups(read: state.Reader, group_size: int) -> dict[GroupKey, list[TrajectoryMeta]]:
    groups: dict[GroupKey, list[TrajectoryMeta]] = {}
    for k, members in enumerate(_blocks(read)):
        if not 0 < len(members) < group_size:
            raise ValueError(
                f"{read.where}: sizes[{k}]={len(members)}: an incomplete group has 1 to "
                f"group_size - 1 = {group_size - 1} members"
            )
        key = (members[0].source, members[0].sample_id)
        if key in groups:
            raise ValueError(
                f"admission state: inconsistent: one incomplete group per (source, sample_id): "
                f"open_groups[{k}] repeats group {key}"
            )
        groups[key] = members
    return groups


def _window(read: state.Reader, group_size: int) -> Generation:
    ids = read.entries("ids")
    if not all(isinstance(v, str) for v in ids):
        raise ValueError(f"{read.where}: ids: expected a list of strings")
    groups: dict[GroupKey, list[int]] = {}
    for k, row in enumerate(read.entries("discarded_groups")):
        where = f"{read.where}: discarded_groups[{k}]"
        if not isinstance(row, list) or len(row) != 4:
            raise ValueError(f"{where}: expected [source, sample_id, rollout_step, expected]")
        source, sample = (checks.name(v, where) for v in row[:2])
        step = checks.whole(row[2], f"{where}: rollout_step")
        expected = checks.whole(row[3], f"{where}: expected", minimum=1)
        if expected >= group_size:
            raise ValueError(f"{where}: expected={expected} must be below group_size")
        groups[(source, sample)] = [step, expected]
    return Generation(dict.fromkeys(ids), groups)


def _broken(invariant: str, detail: str) -> ValueError:
    return ValueError(
        f"admission state: inconsistent: {invariant}: {detail}; the state was damaged or "
        f"edited (load an intact checkpoint)"
    )


def _check_invariants(r: Restored, shape: Shape) -> set[str]:
    """The invariants the running controller keeps; the first broken one is named. Returns the
    pending ids. The pool, which may hold millions, is checked column by column in C-level
    passes, without making its metadata (NOTE [ Restored pool kept as columns ])."""
    pooled = dict(zip(COLUMNS, r.pool.columns, strict=True))
    grouped = [t for members in r.groups.values() for t in members]
    _check_groups(r, shape, pooled, grouped)
    pending_ids = _check_ids(r, pooled["trajectory_id"], grouped)
    _check_batch(r, shape)
    _check_counters(r, shape, len(pooled["trajectory_id"]) + len(grouped))
    newest = max(pooled["max_version"], default=None)
    for t in grouped:
        newest = t.max_version if newest is None else max(newest, t.max_version)
    _check_versions(r, shape, newest)
    return pending_ids


def _check_groups(
    r: Restored, shape: Shape, pooled: dict[str, list[Any]], grouped: list[TrajectoryMeta]
) -> None:
    """Known sources; whole GRPO groups (one source, prompt and rollout step); a pool in
    completion order."""
    g, sources = shape.group_size, set(shape.sources)
    blocks = [("pool", set(pooled["source"])), ("open_groups", {t.source for t in grouped})]
    blocks += [(f"open_minibatches[{k}]", {t.source for t in mb}) for k, mb in enumerate(r.ledger)]
    blocks.append(("last_minibatch", set() if r.last is None else {t.source for t in r.last[2]}))
    for name, named in blocks:
        unknown = named - sources
        if unknown:
            raise _broken("every trajectory has a configured source", f"{name} names {unknown}")
    # The pool's groups are whole by construction: it saves their shared fields once per unit.
    units = [
        (f"open_minibatches[{k}]", mb[i : i + g])
        for k, mb in enumerate(r.ledger)
        for i in range(0, len(mb), g)
    ]
    units += [("open_groups", tuple(m)) for m in r.groups.values()]
    for name, members in units:
        if len({(t.source, t.sample_id, t.rollout_step) for t in members}) != 1:
            raise _broken(
                "a GRPO group's members share source, sample_id and rollout step",
                f"{name} has a group of {[t.trajectory_id for t in members]} naming "
                f"{sorted({(t.source, t.sample_id, t.rollout_step) for t in members})}",
            )
    seqs = list(map(attrgetter("seq"), r.units))
    if not _in_completion_order(seqs, list(map(attrgetter("source"), r.units)), r.seq):
        last: dict[str, int] = {}
        for k, unit in enumerate(r.units):
            if unit.seq >= r.seq or unit.seq <= last.get(unit.source, -1):
                raise _broken(
                    "pool units are numbered below seq, each source in completion order",
                    f"pool unit {k} has seq {unit.seq} (seq={r.seq}, previous of "
                    f"{unit.source!r}: {last.get(unit.source)})",
                )
            last[unit.source] = unit.seq
    if len(set(seqs)) != len(seqs):
        raise _broken("pool units have distinct sequence numbers", "a sequence number repeats")


def _in_completion_order(seqs: list[int], sources: list[str], below: int) -> bool:
    """Every sequence number is below ``below`` and each source's increase (C-level passes)."""
    if max(seqs, default=-1) >= below:
        return False
    for source in set(sources):
        mine = list(itertools.compress(seqs, map(operator.eq, sources, itertools.repeat(source))))
        if not all(map(operator.lt, mine, itertools.islice(mine, 1, None))):
            return False
    return True


def _check_ids(r: Restored, pooled: list[str], grouped: list[TrajectoryMeta]) -> set[str]:
    """Pending ids are unique, not in the open train batch, not settled; the open train batch's
    ids settled in its window."""
    pending = pooled + [t.trajectory_id for t in grouped]
    pending_ids = set(pending)
    if len(pending_ids) != len(pending):
        twice = next(tid for tid, count in Counter(pending).items() if count > 1)
        raise _broken("each pending trajectory id once", f"{twice!r} is pending twice")
    ledger_ids = [t.trajectory_id for mb in r.ledger for t in mb]
    clash = pending_ids.intersection(ledger_ids)
    if clash:
        raise _broken(
            "a pending trajectory is not in the open train batch",
            f"{sorted(clash)[:3]} are pending and admitted",
        )
    settled = pending_ids.intersection(r.recent.current.ids)
    settled |= pending_ids.intersection(r.recent.previous.ids)
    if settled:
        raise _broken(
            "a pending trajectory has not settled",
            f"{sorted(settled)[:3]} are pending and in the duplicate window",
        )
    missing = [tid for tid in ledger_ids if tid not in r.recent.current.ids]
    if missing:
        raise _broken(
            "the open train batch's trajectories settled in its window",
            f"{missing[:3]} are admitted but not in recent.current",
        )
    return pending_ids


def _check_batch(r: Restored, shape: Shape) -> None:
    """The open train batch: mini-batch sizes, admitted counts, bounds, the guard, starts."""
    for k, mb in enumerate(r.ledger):
        if len(mb) != shape.minibatch_sizes[k]:
            raise _broken(
                "each admitted mini-batch has its size",
                f"open_minibatches[{k}] holds {len(mb)}, mini-batch {k} has "
                f"{shape.minibatch_sizes[k]}",
            )
    counted = Counter(t.source for mb in r.ledger for t in mb)
    if any(counted[s] != r.admitted[s] for s in shape.sources):
        raise _broken(
            "admitted counts are the open train batch's trajectories per source",
            f"admitted {r.admitted}, the mini-batches hold {dict(counted)}",
        )
    if shape.enforce_quotas:
        free = shape.train_batch_size - sum(r.admitted.values())
        deficit = 0
        for q in shape.quotas:
            have = r.admitted[q.source]
            if q.groups.usable(have) < have:
                raise _broken(
                    "the open train batch is within its upper bounds",
                    f"{have} of {q.source!r} admitted, at most {q.groups.upper}",
                )
            deficit += q.groups.deficit(have)
        if shape.guarded and deficit > free:
            raise _broken(
                "the open train batch can still meet its lower bounds (the guard)",
                f"they miss {deficit} trajectories, {free} slots are left",
            )
    for q in shape.quotas:
        if not 0 <= r.starts[q.source] <= q.lower:
            raise _broken(
                "starting counts lie within [0, lower bound]",
                f"starts[{q.source!r}]={r.starts[q.source]}, lower bound {q.lower}",
            )


def _check_counters(r: Restored, shape: Shape, pending: int) -> None:
    """Every reported trajectory settled once or is pending; the totals agree."""
    c = r.counters
    ledger = sum(map(len, r.ledger))
    settled = c["admitted"] + c["rejected"] + c["stale_dropped"] + c["discarded"]
    if c["reported"] != settled + pending:
        raise _broken(
            "reported = admitted + rejected + stale_dropped + discarded + pending",
            f"{c['reported']} != {c['admitted']} + {c['rejected']} + {c['stale_dropped']} + "
            f"{c['discarded']} + {pending}",
        )
    if c["admitted"] != r.train_batch * shape.train_batch_size + ledger:
        raise _broken(
            "stats.admitted = train_batch x train_batch_size + the open train batch's",
            f"{c['admitted']} != {r.train_batch} x {shape.train_batch_size} + {ledger}",
        )
    if c["discarded_late"] > c["discarded"]:
        raise _broken(
            "discarded_late counts part of discarded", f"{c['discarded_late']} > {c['discarded']}"
        )
    if sum(r.completed.values()) != c["reported"]:
        raise _broken(
            "completed_by_step sums to stats.reported",
            f"{sum(r.completed.values())} != {c['reported']}",
        )


def _check_versions(r: Restored, shape: Shape, newest: int | None) -> None:
    """Versions (``newest``: the newest of the pending trajectories), staleness and the last
    admitted mini-batch."""
    reported = r.counters["reported"]
    if (r.newest_version is None) != (reported == 0):
        raise _broken(
            "newest_version is set once anything was reported",
            f"newest_version={r.newest_version}, reported={reported}",
        )
    if newest is not None and r.newest_version is not None and newest > r.newest_version:
        raise _broken(
            "newest_version is the newest reported version",
            f"a pending trajectory has {newest}, newest_version={r.newest_version}",
        )
    if shape.max_staleness is not None and r.units:
        oldest = shape.initial_version + r.train_batch - shape.max_staleness
        if min(map(attrgetter("min_version"), r.units)) < oldest:
            raise _broken(
                "pool units are within max_staleness", f"a unit's oldest version is below {oldest}"
            )
    n = len(shape.minibatch_sizes)
    if r.minibatch:
        expected: tuple[int, int] | None = (r.train_batch, r.minibatch - 1)
    else:
        expected = None if r.train_batch == 0 else (r.train_batch - 1, n - 1)
    got = None if r.last is None else (r.last[0], r.last[1])
    if got != expected or (r.minibatch and r.last is not None and r.last[2] != r.ledger[-1]):
        raise _broken(
            "last_minibatch is the last one admitted",
            f"it is {got}, the position says {expected}",
        )


def _minibatch(read: state.Reader) -> tuple[int, int, tuple[TrajectoryMeta, ...]] | None:
    position = read.get("position")
    metas = tuple(state.decode_metas(read.get("trajectories"), f"{read.where}: trajectories"))
    if position is None:
        if metas:
            raise ValueError(f"{read.where}: trajectories without a position")
        return None
    if not isinstance(position, list) or len(position) != 2:
        raise ValueError(f"{read.where}: position: expected [train_batch, index]")
    return (
        checks.whole(position[0], f"{read.where}: train_batch"),
        checks.whole(position[1], f"{read.where}: index"),
        metas,
    )
