"""Trace generator and the JSONL trace format."""

from __future__ import annotations

import re
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


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"source": "A", "sample_id": "x", "duration_s": NaN}', "duration_s=nan"),
        ('{"source": "A", "sample_id": "x", "duration_s": Infinity}', "duration_s=inf"),
        ('{"source": "A", "sample_id": "x", "duration_s": -1.5}', "duration_s=-1.5"),
        ('{"source": "A", "sample_id": "x", "duration_s": "3"}', "duration_s='3'"),
        ('{"source": "A", "sample_id": "x", "duration_s": 3, "tokens": 12.5}', "tokens=12.5"),
        ('{"source": "A", "sample_id": "x", "duration_s": 3, "tokens": -2}', "tokens=-2"),
        ('{"source": "A", "sample_id": "x", "duration_s": 3, "accepted": "no"}', "accepted='no'"),
        ('{"source": "", "sample_id": "x", "duration_s": 3}', "source=''"),
        ('{"sample_id": "x", "duration_s": 3}', "missing field source"),
    ],
)
def test_invalid_records_are_rejected_naming_file_line_and_field(
    tmp_path: Path, line: str, field: str
) -> None:
    """NaN, infinite, negative or non-numeric durations, fractional or negative token counts,
    non-boolean acceptance and missing fields are refused with the file, line and field."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"source": "A", "sample_id": "ok", "duration_s": 3, "tokens": 7.0}\n' + line)
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{re.escape(field)}"):
        read_jsonl(path)


def test_a_trace_of_zero_length_trajectories_is_rejected(tmp_path: Path) -> None:
    """A trace with no rollout time at all is refused (it used to replay to NaN figures)."""
    path = tmp_path / "zero.jsonl"
    path.write_text(
        "".join(f'{{"source": "A", "sample_id": "s{k}", "duration_s": 0}}\n' for k in range(5))
    )
    with pytest.raises(ValueError, match=r"zero.jsonl:1-5: field duration_s is 0 in every record"):
        read_jsonl(path)
