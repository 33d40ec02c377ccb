"""Reading a saved admission state back: every field checked before anything is applied."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from knitkit.admission import checks, state
from knitkit.admission.pool import Unit
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
    ledger: list[tuple[str, ...]]
    """Trajectory ids of each mini-batch admitted into the open train batch."""
    units: list[Unit]
    """The ready pool, oldest first."""
    groups: dict[tuple[str, str], list[TrajectoryMeta]]
    seen: list[str]
    open_ready: dict[str, int]
    open_completed: Counter[int]
    completed: Counter[int]
    issued: Counter[int]
    newest_version: int | None
    last: tuple[int, int, tuple[TrajectoryMeta, ...]] | None


def read_state(
    saved: Mapping[str, Any], fingerprint: Mapping[str, Any], counters: Sequence[str]
) -> Restored:
    """Check ``saved`` against the controller's ``fingerprint`` and decode it; ValueError names
    each config difference, or the first malformed field."""
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
    sources: list[str] = fingerprint["sources"]
    quotas = [q[0] for q in fingerprint["quotas"]]
    group_size: int = fingerprint["group_size"]
    section = read.section("stats")
    restored = Restored(
        counters={name: section.whole(name) for name in counters},
        seq=read.whole("seq"),
        train_batch=read.whole("train_batch"),
        minibatch=read.whole("minibatch"),
        admitted=dict(zip(sources, read.wholes("admitted", len(sources)), strict=True)),
        starts={
            source: checks.finite(v, f"admission state: starts[{k}]")
            for k, (source, v) in enumerate(
                zip(quotas, read.entries("starts", len(quotas)), strict=True)
            )
        },
        ledger=[],
        units=[],
        groups={},
        seen=_strings(read.get("seen"), "admission state: seen"),
        open_ready={},
        open_completed=read.section("open_view").counter("completed_by_step"),
        completed=read.counter("completed_by_step"),
        issued=read.counter("issued_by_step"),
        newest_version=read.optional_whole("newest_version"),
        last=_minibatch(read.get("last_minibatch")),
    )
    if restored.minibatch >= fingerprint["num_minibatches"]:
        raise ValueError(
            f"admission state: minibatch={restored.minibatch}: must be < num_minibatches"
        )
    restored.ledger = [
        tuple(_strings(ids, f"admission state: open_minibatches[{k}]"))
        for k, ids in enumerate(read.entries("open_minibatches", restored.minibatch))
    ]
    ready = read.section("open_view").wholes("ready", len(sources))
    restored.open_ready = dict(zip(sources, ready, strict=True))
    previous = -1
    for k, row in enumerate(read.entries("pool")):
        unit = _unit(row, f"admission state: pool[{k}]", restored.seq, sources, group_size)
        if unit.seq <= previous:
            raise ValueError(f"admission state: pool[{k}]: units must be in completion order")
        restored.units.append(unit)
        previous = unit.seq
    for k, row in enumerate(read.entries("open_groups")):
        where = f"admission state: open_groups[{k}]"
        if not isinstance(row, list) or not 0 < len(row) < group_size:
            raise ValueError(f"{where}: expected 1 to group_size - 1 trajectory rows")
        members = [state.decode_meta(m, where) for m in row]
        key = (members[0].source, members[0].sample_id)
        if key[0] not in sources or key in restored.groups:
            raise ValueError(f"{where}: group {key} names no source or repeats a group")
        if any((m.source, m.sample_id) != key for m in members):
            raise ValueError(f"{where}: the members of group {key} disagree")
        restored.groups[key] = members
    if len(set(restored.seen)) != restored.counters.get("reported", len(restored.seen)) or sum(
        map(len, restored.ledger)
    ) != sum(restored.admitted.values()):
        raise ValueError(
            "admission state: inconsistent: seen ids vs stats.reported, or the open train "
            "batch's mini-batch ids vs its admitted counts"
        )
    return restored


def _unit(row: object, where: str, seq: int, sources: Sequence[str], size: int) -> Unit:
    if not isinstance(row, list) or len(row) != 2 or not isinstance(row[1], list):
        raise ValueError(f"{where}: expected [seq, [trajectory rows]]")
    metas = tuple(state.decode_meta(m, where) for m in row[1])
    if len(metas) != size or len({m.source for m in metas}) != 1:
        raise ValueError(f"{where}: expected {size} trajectories of one source")
    if metas[0].source not in sources:
        raise ValueError(f"{where}: unknown source {metas[0].source!r}")
    number = checks.whole(row[0], f"{where}: seq")
    if number >= seq:
        raise ValueError(f"{where}: seq={number} is not below the saved seq={seq}")
    return Unit(number, metas[0].source, metas)


def _minibatch(row: object) -> tuple[int, int, tuple[TrajectoryMeta, ...]] | None:
    if row is None:
        return None
    where = "admission state: last_minibatch"
    if not isinstance(row, list) or len(row) != 3 or not isinstance(row[2], list):
        raise ValueError(f"{where}: expected [train_batch, index, [trajectory rows]]")
    return (
        checks.whole(row[0], f"{where}: train_batch"),
        checks.whole(row[1], f"{where}: index"),
        tuple(state.decode_meta(m, where) for m in row[2]),
    )


def _strings(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: expected a list of strings")
    return value
