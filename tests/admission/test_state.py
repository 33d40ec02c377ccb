"""AdmissionController.state_dict / load_state_dict: plain data, exact resume, refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from knitkit.admission import (
    POLICY_NAMES,
    AdmissionController,
    CompletionQuota,
    SourceQuota,
    build_controller,
)
from knitkit.admission.pool import Unit
from knitkit.admission.state import encode_pool
from knitkit.types import MultimodalRef, TrajectoryMeta, UnitKey

Event = tuple[Any, ...]
"""("issue", step, count) | ("report", TrajectoryMeta) | ("admit",) | ("discard",)."""


@dataclasses.dataclass
class Setup:
    policy: str
    options: dict[str, Any]
    events: list[Event]

    def build(self) -> AdmissionController:
        return build_controller(self.policy, **self.options)


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    """A random policy and config (quotas with bounds, GRPO groups, staleness bound, completion
    quota) and a random event trace: rollout steps issued, GRPO group members completing
    interleaved (some rejected, versions rising), admission attempts, an occasional discard."""
    policy = draw(st.sampled_from(POLICY_NAMES))
    sources = list("abc"[: draw(st.integers(1, 3))])
    n = draw(st.sampled_from([1, 2, 4, 4]))
    group = draw(st.sampled_from([1, 2, 3]))
    batch = n * group * draw(st.integers(1, 4))
    quotas, budget = [], batch
    for s in sources:
        lower = draw(st.integers(0, budget)) // group * group
        budget -= lower
        upper = draw(st.one_of(st.none(), st.integers(max(lower, batch // 2), batch)))
        quotas.append(SourceQuota(source=s, min_count=lower, max_count=upper))
    quotas[-1] = dataclasses.replace(quotas[-1], max_count=None)  # a full batch stays possible
    options: dict[str, Any] = {
        "train_batch_size": batch,
        "num_minibatches": n,
        "sources": sources,
        "quotas": quotas,
        "group_size": group,
        "max_staleness": draw(st.one_of(st.none(), st.integers(0, 2))),
    }
    if draw(st.booleans()):
        options["predicates"] = (CompletionQuota(draw(st.sampled_from([0.0, 0.3, 0.8]))),)
    rng = draw(st.randoms(use_true_random=False))
    events: list[Event] = []
    open_groups: list[tuple[str, str, int, int]] = []  # source, sample, step, members left
    discarded: set[tuple[str, str, int]] = set()
    step = version = serial = 0
    for _ in range(draw(st.integers(0, 120))):
        roll = rng.random()
        if roll < 0.05:
            step += 1
            version += rng.random() < 0.5
            events.append(("issue", step, rng.randrange(4 * batch)))
        elif roll < 0.07:
            events.append(("discard",))
            # The controller drops incomplete groups too, and discards their late members:
            # a new group never reuses a discarded one's prompt at its rollout step.
            discarded |= {g[:3] for g in open_groups}
            open_groups.clear()
        elif roll < 0.25:
            events.append(("admit",))
        else:
            if not open_groups or rng.random() < 0.3:
                sample = str(rng.randrange(6))  # ids repeat across sources and steps
                source = rng.choice(sources)
                if (source, sample, step) in discarded or any(
                    g[0] == source and g[1] == sample for g in open_groups
                ):
                    continue
                open_groups.append((source, sample, step, group))
            k = rng.randrange(len(open_groups))
            source, sample, issued, left = open_groups[k]
            low = max(0, version - rng.randrange(3))
            refs = (
                (MultimodalRef(UnitKey(f"img{serial % 3}", "image"), 2, 4, 1.5),)
                if serial % 4
                else ()
            )
            meta = TrajectoryMeta(
                f"t{serial}", sample, source, issued, rng.randrange(50), low, version,
                rng.random() < 0.9, refs,
            )  # fmt: skip
            serial += 1
            events.append(("report", meta))
            if left == 1:
                del open_groups[k]
            else:
                open_groups[k] = (source, sample, issued, left - 1)
    return Setup(policy, options, events)


def play(ctl: AdmissionController, events: list[Event]) -> list[tuple[int, int, list[str]]]:
    """Feed ``events``; returns every admitted mini-batch as (train batch, index, ids)."""
    out = []
    for item in events:
        if item[0] == "issue":
            ctl.issued(item[1], item[2])
        elif item[0] == "discard":
            ctl.discard_pending()
        elif item[0] == "report":
            ctl.report(item[1])
        while item[0] in ("admit", "report") and (mb := ctl.next_minibatch()) is not None:
            out.append((mb.train_batch, mb.index, [t.trajectory_id for t in mb.trajectories]))
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), data=st.data())
def test_a_restored_controller_admits_exactly_what_the_uninterrupted_one_admits(
    setup: Setup, data: st.DataObject
) -> None:
    """Resume invariant: a controller restored from a state dict (through JSON) at any point of
    a trace, mid train batch included, and fed the remaining events admits exactly the
    mini-batches the uninterrupted controller admits, and ends in the same state."""
    whole = setup.build()
    expected, mid = [], []
    for k, item in enumerate(setup.events):
        expected += play(whole, [item])
        if whole.metrics()["knitkit/admission/minibatch"] > 0:
            mid.append(k + 1)  # a state taken after this event is mid train batch
    cuts = st.integers(0, len(setup.events))
    cut = data.draw(st.sampled_from(mid) | cuts if mid else cuts, label="cut")
    first = setup.build()
    before = play(first, setup.events[:cut])
    saved = json.loads(json.dumps(first.state_dict()))
    event("mid train batch" if saved["minibatch"] else "at a train-batch boundary")
    resumed = setup.build()
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == first.state_dict()
    assert before + play(resumed, setup.events[cut:]) == expected
    assert resumed.state_dict() == whole.state_dict()
    assert resumed.metrics() == whole.metrics()


def controller(**changes: Any) -> AdmissionController:
    options: dict[str, Any] = {
        "train_batch_size": 8,
        "num_minibatches": 4,
        "sources": ["a", "b"],
        "quotas": [SourceQuota(source="a", min_count=4)],
        "group_size": 2,
    }
    policy = changes.pop("policy", "knittrans")
    options.update(changes)
    return build_controller(policy, **options)


def mid_batch() -> AdmissionController:
    """A controller with one train batch closed, one mini-batch of the next admitted, a pool
    and an incomplete GRPO group."""
    ctl = controller()
    for i in range(19):
        ctl.report(TrajectoryMeta(f"t{i}", f"s{i // 2}", "ab"[i // 2 % 2], 0, 5, 0, 1))
        if i < 14:
            ctl.next_minibatch()
    assert (ctl.train_batch, ctl.metrics()["knitkit/admission/minibatch"]) == (1, 3.0)
    return ctl


def test_the_state_is_plain_json_data_with_the_open_train_batch() -> None:
    """The state dict holds only JSON types; it records the open train batch's index, its
    admitted mini-batches' ids, the pool and the incomplete group."""
    state = mid_batch().state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state["train_batch"] == 1 and state["minibatch"] == 3
    assert state["open_minibatches"]["sizes"] == [2, 2, 2]
    assert len(state["pool"]["seq"]) == 2 and state["open_groups"]["sizes"] == [1]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"sources": ["a", "c"]}, "sources"),
        ({"quotas": [SourceQuota(source="a", min_count=6)]}, "quotas"),
        ({"train_batch_size": 16}, "train_batch_size"),
        ({"num_minibatches": 2}, "num_minibatches"),
        ({"policy": "adaptive"}, "selection"),
        ({"policy": "linear"}, "quotas"),
        ({"policy": "noguard"}, "guards"),
        ({"max_staleness": 3}, "max_staleness"),
    ],
)
def test_a_state_from_another_config_is_refused_naming_the_difference(
    changes: dict[str, Any], field: str
) -> None:
    """load_state_dict refuses a state saved under a different config (sources, quotas, batch
    shape, policy) naming the field that differs, and leaves the controller as it was."""
    other = controller(**changes)
    other.report(TrajectoryMeta("x", "y", "a", 0, 1, 0, 0))
    before = other.state_dict()
    with pytest.raises(ValueError, match=rf"different config.*{field}: saved"):
        other.load_state_dict(mid_batch().state_dict())
    assert other.state_dict() == before


def corrupt(state: dict[str, Any], path: tuple[Any, ...], value: object) -> dict[str, Any]:
    copy = json.loads(json.dumps(state))
    target = copy
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return copy


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("pool",), KeyError, "missing field 'pool'"),
        (("format",), 99, "format=99"),
        (("seq",), 2.5, "seq=2.5"),
        (("minibatch",), 4, "minibatch=4: must be < num_minibatches"),
        (
            ("pool", "trajectories", "num_tokens", 0),
            "0",
            r"pool: trajectories: num_tokens\[0\]='0'",
        ),
        (("pool", "rollout_step", 1), "0", r"pool: rollout_step\[1\]='0'"),
        (("pool", "source"), ["a"], "pool: source: expected a list of 2 entries"),
        (("pool", "trajectories", "num_tokens"), [1], "num_tokens has 1 rows, trajectory_id 4"),
        (("pool", "trajectories", "accepted"), [True] * 4, r"unknown columns \['accepted'\]"),
        (
            ("pool", "trajectories", "source"),
            ["a"] * 4,
            r"pool: trajectories: unknown columns \['source'\]",
        ),
        (("open_groups", "sizes", 0), 0, r"open_groups: sizes \[0\] do not sum"),
        (("admitted",), [1, 2], "admitted: expected a mapping with keys"),
        (("recent", "current", "ids"), [3], "recent: current: ids: expected a list of strings"),
    ],
)
def test_a_malformed_state_is_refused_naming_the_field(
    path: tuple[Any, ...], value: object, message: str
) -> None:
    """A damaged state dict is refused naming the field, and nothing changes."""
    ctl = controller()
    before = ctl.state_dict()
    with pytest.raises(ValueError, match=message):
        ctl.load_state_dict(corrupt(mid_batch().state_dict(), path, value))
    assert ctl.state_dict() == before


def damage(state: dict[str, Any], kind: str) -> None:
    """Break one invariant of ``mid_batch()``'s state (see DAMAGE)."""
    pool = state["pool"]["trajectories"]
    if kind == "a pool unit missing":
        for name in ("seq", "sample_id", "source", "rollout_step"):
            state["pool"][name].pop(0)
        for name in pool:
            if name != "multimodal":
                del pool[name][:2]
    elif kind == "an id twice in the pool":
        pool["trajectory_id"][2] = pool["trajectory_id"][0]
    elif kind == "a pool id in the open train batch":
        pool["trajectory_id"][0] = state["open_minibatches"]["trajectories"]["trajectory_id"][0]
    elif kind == "a pool id already settled":
        pool["trajectory_id"][0] = state["recent"]["previous"]["ids"][0]
    elif kind == "admitted counts swapped":
        state["admitted"] = {"a": state["admitted"]["b"], "b": state["admitted"]["a"]}
    elif kind == "an emptied mini-batch":
        state["open_minibatches"]["sizes"][1:] = [0, 4]
    elif kind == "counters that do not add up":
        state["stats"]["rejected"] += 2
    elif kind == "admitted total off":
        state["stats"]["admitted"] += 2
        state["stats"]["reported"] += 2
        state["completed_by_step"][0][1] += 2
    elif kind == "a group naming two prompts":
        state["open_minibatches"]["trajectories"]["sample_id"][1] = "another prompt"
    elif kind == "pool out of completion order":
        state["pool"]["seq"][0] = state["seq"]
    elif kind == "last mini-batch elsewhere":
        state["last_minibatch"]["position"][1] = 0


DAMAGE = {
    "a pool unit missing": "reported = admitted \\+ rejected",
    "an id twice in the pool": "each pending trajectory id once: 't16' is pending twice",
    "a pool id in the open train batch": "a pending trajectory is not in the open train batch",
    "a pool id already settled": "a pending trajectory has not settled",
    "admitted counts swapped": "admitted counts are the open train batch's trajectories",
    "an emptied mini-batch": r"each admitted mini-batch has its size: open_minibatches\[1\]",
    "counters that do not add up": "reported = admitted \\+ rejected",
    "admitted total off": "stats.admitted = train_batch x train_batch_size",
    "a group naming two prompts": "a GRPO group's members share source, sample_id",
    "pool out of completion order": "pool units are numbered below seq",
    "last mini-batch elsewhere": "last_minibatch is the last one admitted",
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_state_is_refused_naming_the_broken_invariant(kind: str) -> None:
    """A state whose fields are well-formed but break an invariant the controller keeps is
    refused naming the invariant, and nothing changes (issue 30.2: such states loaded, and a
    guarded policy then admitted a trajectory twice or closed a batch short of a quota)."""
    ctl = controller()
    before = ctl.state_dict()
    state = json.loads(json.dumps(mid_batch().state_dict()))
    damage(state, kind)
    with pytest.raises(ValueError, match="inconsistent: " + DAMAGE[kind]):
        ctl.load_state_dict(state)
    assert ctl.state_dict() == before


def test_a_state_loads_whatever_order_its_sources_and_quotas_are_listed_in() -> None:
    """Sources and quotas listed in another order are the same config: a state saved by one
    controller loads into the other, and both go on alike (issue 30.2: refused)."""
    quotas = [SourceQuota(source="a", min_count=4), SourceQuota(source="b", max_count=6)]
    first = controller(quotas=quotas)
    tail: list[Event] = [
        ("report", TrajectoryMeta(f"u{i}", f"r{i // 2}", "ab"[i // 2 % 2], 0, 5, 1, 1))
        for i in range(20)
    ]
    play(first, tail[:9])
    other = controller(sources=["b", "a"], quotas=quotas[::-1])
    other.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert play(other, tail[9:]) == play(first, tail[9:])
    assert other.metrics() == first.metrics()


def test_the_state_holds_what_is_pending_and_the_window_not_the_run() -> None:
    """The state lists what is pending and what settled in the open and the previous train
    batch, however many trajectories were reported before (issue 30.3: every id ever reported,
    22.9 MB at 2M); a retry inside that window is still refused."""
    ctl = controller(quotas=[], group_size=1)
    sizes = []
    for i in range(800):
        ctl.report(TrajectoryMeta(f"t{i}", f"s{i}", "ab"[i % 2], 0, 5, 0, 0))
        ctl.next_minibatch()
        if i in (199, 399, 799):  # at train-batch boundaries, ids of three digits
            sizes.append(len(json.dumps(ctl.state_dict())))
    assert max(sizes) - min(sizes) < 16, sizes  # counters gain digits, nothing else grows
    state = ctl.state_dict()
    assert len(state["recent"]["previous"]["ids"]) == 8 and state["recent"]["current"]["ids"] == []
    with pytest.raises(ValueError, match="'t792' was already reported"):
        ctl.report(TrajectoryMeta("t792", "s", "a", 0, 5, 0, 0))


def test_a_snapshot_keeps_the_state_it_was_taken_at() -> None:
    """snapshot() copies the state (references, O(pending)); encoding it later, after the
    controller has moved on (reports, admissions, a train batch closing, a discard), gives the
    state dict of the moment it was taken: a lock holder copies, and encodes outside the lock."""
    ctl = mid_batch()
    expected = ctl.state_dict()
    snapshot = ctl.snapshot()
    play(
        ctl,
        [
            ("report", TrajectoryMeta(f"u{i}", f"r{i // 2}", "ab"[i % 2], 0, 5, 1, 1))
            for i in range(6)
        ],
    )
    ctl.discard_pending()
    assert ctl.state_dict() != expected
    assert snapshot.state_dict() == expected


def test_a_restored_pool_makes_metadata_only_for_the_units_it_admits() -> None:
    """NOTE [ Restored pool kept as columns ]: a loaded pool keeps the state's columns; a unit
    makes its ``TrajectoryMeta`` objects when admitted, the rest stay columns, and a state
    taken after the load (slices of the columns) equals the saved one and the uninterrupted
    controller's."""
    first = controller(quotas=[], group_size=2, num_minibatches=2, max_staleness=3)
    reports = [
        TrajectoryMeta(f"t{i}", f"s{i // 2}", "ab"[i // 4 % 2], 0, 5, 0, 1) for i in range(40)
    ]
    for meta in reports:
        first.report(meta)
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = controller(quotas=[], group_size=2, num_minibatches=2, max_staleness=3)
    resumed.load_state_dict(saved)
    units = [u for queue in resumed._pool.queues() for u in queue]
    assert len(units) == 20 and all(u.metas is None and u.rows is units[0].rows for u in units)
    assert resumed.state_dict() == saved
    taken, expected = resumed.next_minibatch(), first.next_minibatch()
    assert (
        taken is not None and expected is not None and taken.trajectories == expected.trajectories
    )
    assert sum(u.metas is not None for u in units) == 2  # the mini-batch's two groups
    assert resumed.state_dict() == first.state_dict()
    # A pool with a gap in its block (as an expiry leaves), partly of units made from metadata,
    # encodes as the same units made from metadata do.
    kept = [u for u in units if u.metas is None]
    del kept[3]
    made = [Unit.of(u.seq, u.source, u.trajectories) for u in kept]
    assert encode_pool(kept, 2) == encode_pool(made, 2) == encode_pool(kept[:9] + made[9:], 2)


def test_a_refused_report_leaves_the_whole_state_unchanged() -> None:
    """Every refused report (fractional count, bad acceptance, disagreeing group member,
    duplicate) leaves the complete state dict exactly as it was."""
    ctl = mid_batch()
    before = ctl.state_dict()
    good = TrajectoryMeta("new", "s9", "b", 0, 5, 0, 1)  # joins the open group ("b", "s9")
    for change in (
        {"num_tokens": 2.5},
        {"accepted": "no"},
        {"rollout_step": 4},
        {"trajectory_id": "t3"},
        {"source": "zzz"},
    ):
        with pytest.raises(ValueError):
            ctl.report(dataclasses.replace(good, **change))  # type: ignore[arg-type]
        assert ctl.state_dict() == before, change


def test_the_state_round_trips_through_torch_distributed_checkpoint(tmp_path: Path) -> None:
    """The state dict sits in a torch.distributed.checkpoint save beside tensors; a fresh
    controller's state dict is a valid load template, and the resumed controller goes on
    exactly like the saved one."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import torch

    ctl = mid_batch()
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"admission": ctl.state_dict(), "w": torch.zeros(3)}, checkpoint_id=tmp_path)
    fresh = controller()
    template = {"admission": fresh.state_dict(), "w": torch.ones(3)}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(template, checkpoint_id=tmp_path)
    fresh.load_state_dict(template["admission"])
    tail: list[Event] = [
        ("report", TrajectoryMeta(f"u{i}", f"r{i // 2}", "ab"[i % 3 == 0], 0, 5, 1, 1))
        for i in range(12)
    ]
    assert play(fresh, tail) == play(ctl, tail)
    assert fresh.state_dict() == ctl.state_dict()


def test_the_state_loads_with_torch_load_weights_only(tmp_path: Path) -> None:
    """Beside a model in a torch.save checkpoint, the state loads with weights_only=True (plain
    data, nothing to unpickle) and the controller resumes exactly."""
    torch = pytest.importorskip("torch")
    ctl = mid_batch()
    torch.save({"admission": ctl.state_dict(), "w": torch.zeros(2)}, tmp_path / "ckpt.pt")
    fresh = controller()
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)["admission"])
    assert fresh.state_dict() == ctl.state_dict()
