"""Admission state as plain data: the config fingerprint, trajectory rows, and checked reads of a saved state."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from knitkit.admission import checks
from knitkit.admission.schedules import coefficients
from knitkit.types import MultimodalRef, TrajectoryMeta, UnitKey

if TYPE_CHECKING:
    from knitkit.admission.config import AdmissionConfig, ResolvedQuota

FORMAT = 1
"""Version of the state layout; a state of another format is refused."""

# NOTE [ Admission state ]: ``AdmissionController.state_dict()`` is plain data (ints, floats,
# strings, bools, None, lists, dicts with string keys): it round-trips through JSON, sits in a
# ``torch.distributed.checkpoint`` save beside the model's and optimizer's state (dict keys are
# fixed by the config and variable-length parts are lists, so a fresh controller's state dict
# is a valid load template), and restoring it never unpickles bytes another process wrote.
# It holds everything a decision depends on: the ready pool in completion order (with each
# unit's sequence number, so oldest-first stays oldest-first), incomplete GRPO groups, every
# reported id (duplicates are still refused after a resume), the counters, per-step
# completions and issues, and the open train batch (index, admitted counts, starting counts
# s_{i,0}, the ids each admitted mini-batch took). Resume invariant (property-tested): a
# controller restored from a state and fed the same remaining reports admits exactly what the
# uninterrupted one admits. The config is not saved, only its fingerprint: the caller rebuilds
# the controller from its own config, and a state from a different one (sources, quotas,
# batch shape, policy: schedules, guards, selection) is refused naming each difference. A
# user selection policy or predicate that keeps its own state saves it itself; the built-in
# ones are stateless.


def describe(obj: object) -> str:
    """A stable description of a policy component: a dataclass's repr, else its type's name."""
    if dataclasses.is_dataclass(obj):
        return repr(obj)
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def fingerprint(config: AdmissionConfig, quotas: Sequence[ResolvedQuota]) -> dict[str, Any]:
    """What a saved state must agree on with the controller it is loaded into."""
    n = config.num_minibatches
    budget = config.rollout_budget
    return {
        "sources": list(config.sources),
        "train_batch_size": int(config.train_batch_size),
        "num_minibatches": int(n),
        "group_size": int(config.group_size),
        "quotas": [[q.source, q.lower, q.upper, list(q.alphas)] for q in quotas],
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


def encode_meta(meta: TrajectoryMeta) -> list[Any]:
    """A trajectory's metadata as one row (field order of ``TrajectoryMeta``)."""
    return [
        meta.trajectory_id,
        meta.sample_id,
        meta.source,
        int(meta.rollout_step),
        int(meta.num_tokens),
        int(meta.min_version),
        int(meta.max_version),
        meta.accepted,
        [
            [m.key.owner, m.key.field, int(m.token_start), int(m.num_tokens), float(m.cost)]
            for m in meta.multimodal
        ],
    ]


def decode_meta(row: object, where: str) -> TrajectoryMeta:
    """Inverse of ``encode_meta``, checking every field; ValueError names ``where`` and the field."""
    if not isinstance(row, list) or len(row) != 9:
        raise ValueError(f"{where}: expected a trajectory row of 9 fields, got {_short(row)}")
    tid, sample, source, step, tokens, low, high, accepted, refs = row
    for label, value in (("trajectory_id", tid), ("sample_id", sample), ("source", source)):
        if not isinstance(value, str):
            raise ValueError(f"{where}: {label}={_short(value)}: expected a string")
    if not isinstance(accepted, bool) or not isinstance(refs, list):
        raise ValueError(f"{where}: accepted={accepted!r}, multimodal={_short(refs)}: wrong type")
    multimodal = []
    for ref in refs:
        if not isinstance(ref, list) or len(ref) != 5:
            raise ValueError(f"{where}: multimodal entry {_short(ref)}: expected 5 fields")
        owner, name, start, count, cost = ref
        if not isinstance(owner, str) or not isinstance(name, str):
            raise ValueError(f"{where}: multimodal key {owner!r}/{name!r}: expected strings")
        multimodal.append(
            MultimodalRef(
                UnitKey(owner, name),
                checks.whole(start, f"{where}: token_start"),
                checks.whole(count, f"{where}: num_tokens"),
                checks.finite(cost, f"{where}: cost"),
            )
        )
    return TrajectoryMeta(
        tid,
        sample,
        source,
        checks.whole(step, f"{where}: rollout_step"),
        checks.whole(tokens, f"{where}: num_tokens"),
        checks.whole(low, f"{where}: min_version", minimum=None),
        checks.whole(high, f"{where}: max_version", minimum=None),
        accepted,
        tuple(multimodal),
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
