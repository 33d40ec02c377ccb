"""Rollout traces: per-source trajectory durations, a synthetic generator, and the JSONL file format."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One trajectory of a trace: how long its rollout takes and whether it passes acceptance."""

    source: str
    sample_id: str
    """Prompt (GRPO group) id; consecutive records of a source with one sample_id form a group."""
    duration_s: float
    tokens: int | None = None
    accepted: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"field source={self.source!r}: give a non-empty string")
        if not isinstance(self.sample_id, str):
            raise ValueError(f"field sample_id={self.sample_id!r}: give a string")
        if isinstance(self.duration_s, bool) or not isinstance(self.duration_s, int | float):
            raise ValueError(f"field duration_s={self.duration_s!r}: give a number of seconds")
        if not math.isfinite(self.duration_s) or self.duration_s < 0:
            raise ValueError(
                f"field duration_s={self.duration_s!r}: must be finite and >= 0 (seconds)"
            )
        if self.tokens is not None and (
            isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0
        ):
            raise ValueError(f"field tokens={self.tokens!r}: give a whole count >= 0, or omit it")
        if not isinstance(self.accepted, bool):
            raise ValueError(f"field accepted={self.accepted!r}: give true or false")


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceProfile:
    """Log-normal rollout durations of one source: ``log D = log(median) + u_prompt + e``."""

    name: str
    median_s: float
    sigma: float
    """Total log-space standard deviation."""
    prompt_share: float = 0.5
    """Share of the log-variance that comes from the prompt (siblings of a group are alike)."""
    cap_factor: float = 8.0
    """Durations are capped at ``cap_factor * median_s`` (max_new_tokens / timeout)."""
    tokens_per_s: float = 20.0
    accept_prob: float = 1.0
    """Probability that one trajectory passes acceptance."""
    group_reject_prob: float = 0.0
    """Probability that a whole GRPO group is rejected (dynamic sampling drops groups whose
    rewards are all equal), on top of ``accept_prob``."""


@dataclass(frozen=True, slots=True)
class Trace:
    """Per-source trajectory records in issue order: the k-th issue of a source always gets record k."""

    records: dict[str, tuple[TraceRecord, ...]]
    group_size: int = 1

    def __post_init__(self) -> None:
        if not any(self.records.values()):
            raise ValueError("empty trace: give at least one record")
        if all(r.duration_s == 0 for recs in self.records.values() for r in recs):
            raise ValueError(
                "field duration_s is 0 in every record: a trace needs some rollout time"
            )

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(self.records)

    def mean_duration(self, source: str) -> float:
        records = self.records[source]
        return sum(r.duration_s for r in records) / max(1, len(records))


def generate_trace(
    profiles: Sequence[SourceProfile], *, samples_per_source: int, group_size: int, seed: int
) -> Trace:
    """Draw ``samples_per_source`` GRPO groups of ``group_size`` per source, independently per source."""
    records: dict[str, tuple[TraceRecord, ...]] = {}
    for index, profile in enumerate(profiles):
        rng = np.random.default_rng([seed, index])
        prompt = rng.normal(
            0.0, profile.sigma * math.sqrt(profile.prompt_share), samples_per_source
        )
        noise = rng.normal(
            0.0,
            profile.sigma * math.sqrt(1.0 - profile.prompt_share),
            (samples_per_source, group_size),
        )
        durations = np.minimum(
            profile.median_s * np.exp(prompt[:, None] + noise),
            profile.cap_factor * profile.median_s,
        )
        accepted = rng.random((samples_per_source, group_size)) < profile.accept_prob
        accepted &= (rng.random(samples_per_source) >= profile.group_reject_prob)[:, None]
        records[profile.name] = tuple(
            TraceRecord(
                profile.name,
                f"{profile.name}-{p}",
                float(durations[p, r]),
                max(1, round(float(durations[p, r]) * profile.tokens_per_s)),
                bool(accepted[p, r]),
            )
            for p in range(samples_per_source)
            for r in range(group_size)
        )
    return Trace(records, group_size)


def write_jsonl(trace: Trace, path: str | Path) -> None:
    """Write one JSON object per trajectory: source, sample_id, duration_s, tokens, accepted."""
    with open(path, "w", encoding="utf-8") as f:
        for recs in trace.records.values():
            for rec in recs:
                f.write(json.dumps(asdict(rec)) + "\n")


def read_jsonl(path: str | Path) -> Trace:
    """Read a JSONL trace; records keep file order per source; the group size is inferred.

    A bad record raises ValueError naming the file, the line and the field.
    """
    by_source: dict[str, list[tuple[int, TraceRecord]]] = {}
    line_no = 0
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("a line must be one JSON object")
                missing = [k for k in ("source", "sample_id", "duration_s") if k not in obj]
                if missing:
                    raise ValueError(f"missing field {missing[0]}")
                tokens = obj.get("tokens")
                if isinstance(tokens, float) and tokens.is_integer():
                    tokens = int(tokens)  # 120.0 is a whole count; 120.5 is refused
                sample = obj["sample_id"]
                if type(sample) is int:
                    sample = str(sample)  # prompt numbers are common ids; null is refused
                rec = TraceRecord(
                    obj["source"], sample, obj["duration_s"], tokens, obj.get("accepted", True)
                )
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                raise ValueError(
                    f"{path}:{line_no}: not a trace record: {exc} (need source, sample_id, "
                    f"duration_s; optional tokens, accepted)"
                ) from exc
            by_source.setdefault(rec.source, []).append((line_no, rec))
    group_size = _group_size(by_source, path)
    try:
        return Trace({s: tuple(r for _, r in rows) for s, rows in by_source.items()}, group_size)
    except ValueError as exc:
        raise ValueError(f"{path}:1-{line_no}: {exc}") from exc


def _group_size(by_source: dict[str, list[tuple[int, TraceRecord]]], path: str | Path) -> int:
    """The one size of every GRPO group (a run of records of a source with one sample_id)."""
    groups: list[tuple[int, int, TraceRecord]] = []  # (size, first line, first record)
    for rows in by_source.values():
        for _, run in itertools.groupby(rows, key=lambda row: row[1].sample_id):
            members = list(run)
            groups.append((len(members), members[0][0], members[0][1]))
    if not groups:
        return 1  # an empty trace; Trace refuses it
    common = Counter(size for size, _, _ in groups).most_common(1)[0][0]
    for size, line, rec in groups:
        if size != common:
            raise ValueError(
                f"{path}:{line}: GRPO group (source {rec.source!r}, sample_id {rec.sample_id!r}) "
                f"has {size} trajectories, other groups {common}; consecutive records of a "
                f"source with one sample_id form a group, and every group has the same size"
            )
    return common
