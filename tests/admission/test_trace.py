"""Trace generator and the JSONL trace format."""

from __future__ import annotations

from pathlib import Path

import pytest

from knitkit.admission.replay import SourceProfile, generate_trace, read_jsonl, write_jsonl

PROFILES = (
    SourceProfile(name="A", median_s=10.0, sigma=0.5, cap_factor=3.0),
    SourceProfile(name="B", median_s=40.0, sigma=1.0, cap_factor=2.0, accept_prob=0.5),
)


def test_jsonl_round_trip(tmp_path: Path) -> None:
    """Writing then reading a trace gives the same records and group size."""
    trace = generate_trace(PROFILES, samples_per_source=5, group_size=4, seed=3)
    path = tmp_path / "trace.jsonl"
    write_jsonl(trace, path)
    again = read_jsonl(path)
    assert again == trace
    assert again.group_size == 4


def test_generator_is_seeded_capped_and_per_source() -> None:
    """Same seed, same trace; caps hold; a source's records do not depend on the other sources."""
    a = generate_trace(PROFILES, samples_per_source=50, group_size=2, seed=1)
    assert a == generate_trace(PROFILES, samples_per_source=50, group_size=2, seed=1)
    assert a != generate_trace(PROFILES, samples_per_source=50, group_size=2, seed=2)
    assert max(r.duration_s for r in a.records["A"]) <= 30.0
    assert max(r.duration_s for r in a.records["B"]) <= 80.0
    assert 0 < sum(r.accepted for r in a.records["B"]) < 100
    alone = generate_trace(PROFILES[:1], samples_per_source=50, group_size=2, seed=1)
    assert alone.records["A"] == a.records["A"]


def test_bad_trace_lines_name_the_line(tmp_path: Path) -> None:
    """A malformed or negative record is reported with its file and line number."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"source": "A", "sample_id": "x", "duration_s": 3}\n{"source": "A"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a trace record"):
        read_jsonl(path)
    path.write_text('{"source": "A", "sample_id": "x", "duration_s": -3}\n')
    with pytest.raises(ValueError, match=r":1: negative duration_s"):
        read_jsonl(path)
