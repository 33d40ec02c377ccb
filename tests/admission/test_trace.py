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


@pytest.mark.parametrize(
    ("sample", "field"),
    [("null", "sample_id=None"), ("1.5", "sample_id=1.5"), ("true", "sample_id=True")],
)
def test_a_sample_id_that_is_not_an_id_is_refused(tmp_path: Path, sample: str, field: str) -> None:
    """A null, fractional or boolean sample_id is refused naming the file, line and field (it
    used to become the string "None"); whole numbers are ids and read as strings."""
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"source": "A", "sample_id": 7, "duration_s": 3}\n'
        f'{{"source": "A", "sample_id": {sample}, "duration_s": 3}}\n'
    )
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{re.escape(field)}"):
        read_jsonl(path)
    path.write_text('{"source": "A", "sample_id": 7, "duration_s": 3}\n')
    assert read_jsonl(path).records["A"][0].sample_id == "7"


def test_a_group_of_another_size_is_refused_naming_it(tmp_path: Path) -> None:
    """Every GRPO group of a trace has one size: one 7-member group among 8-member groups is
    refused naming its line, source and sample_id (it silently made the group size 1)."""
    path = tmp_path / "groups.jsonl"
    sizes = {"p0": 8, "p1": 7, "p2": 8}
    path.write_text(
        "".join(
            f'{{"source": "A", "sample_id": "{p}", "duration_s": 3}}\n'
            for p, size in sizes.items()
            for _ in range(size)
        )
    )
    with pytest.raises(
        ValueError, match=r"groups.jsonl:9: GRPO group \(source 'A', sample_id 'p1'\) has 7"
    ):
        read_jsonl(path)


def test_group_rejection_rejects_whole_groups() -> None:
    """``group_reject_prob`` rejects GRPO groups whole (dynamic sampling's filter), leaving the
    rest of the trace as it was drawn."""
    profile = SourceProfile(name="A", median_s=10.0, sigma=0.5, group_reject_prob=0.4)
    trace = generate_trace((profile,), samples_per_source=500, group_size=4, seed=0)
    plain = generate_trace(
        (SourceProfile(name="A", median_s=10.0, sigma=0.5),),
        samples_per_source=500,
        group_size=4,
        seed=0,
    )
    records = trace.records["A"]
    groups = [records[k : k + 4] for k in range(0, len(records), 4)]
    assert all(len({r.accepted for r in g}) == 1 for g in groups)
    assert 0.3 < sum(not g[0].accepted for g in groups) / len(groups) < 0.5
    assert [r.duration_s for r in records] == [r.duration_s for r in plain.records["A"]]
