"""Plans and planner inputs are checked at the boundary: double use, budgets (issue 9, classes 8, 10)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from delivery_payloads import make_metas, plan_for, trajectories

from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.planning.plan import MiniBatchPlan, Topology
from knitkit.storage.planning.planner import PlannerConfig, plan_minibatch
from knitkit.storage.units.store import TrajectoryStore
from knitkit.types import MultimodalRef, UnitKey


def _store(lengths: list[int]) -> TrajectoryStore:
    store = TrajectoryStore(MemoryBackend())
    for trajectory in trajectories(make_metas(lengths)):
        store.write(trajectory)
    return store


def test_a_trajectory_registered_into_two_mini_batches_is_refused() -> None:
    """Registering a trajectory that an outstanding mini-batch already plans raises ``ValueError``
    naming it and both mini-batches; the first registration still frees its units normally."""
    store = _store([30, 40, 50])
    metas = store.metas()
    first = store.register(plan_for(metas[:2], Topology(dp=1), None, "mb0"))
    with pytest.raises(ValueError, match=r"'t1'.*'mb1'.*'mb0'"):
        store.register(plan_for(metas[1:], Topology(dp=1), None, "mb1"))
    with pytest.raises(KeyError, match="mb1"):
        store.outstanding("mb1")  # nothing of the refused plan was registered
    store.consumed("mb0", first.consumers[0].name)
    assert store.index.trajectory_ids() == ("t2",)
    second = store.register(plan_for(metas[2:], Topology(dp=1), None, "mb1"))
    assert store.consumed("mb1", second.consumers[0].name)


def test_duplicate_metadata_is_not_planned_twice() -> None:
    """The same trajectory's metadata given twice to the planner, or a plan that carries one
    trajectory twice (on one rank or on two DP ranks), is refused naming the trajectory."""
    store = _store([30, 40, 50])
    metas = store.metas()
    with pytest.raises(ValueError, match="'t1' is given twice"):
        plan_minibatch([*metas, metas[1]], Topology(dp=2))
    plan = plan_for(metas, Topology(dp=2), None, "mb0")
    donor = next(c for c in plan.consumers if c.micro_batches[0].sequences)
    seq = donor.micro_batches[0].sequences[0]
    for target in (donor, next(c for c in plan.consumers if c is not donor)):
        micro = target.micro_batches[0]
        doubled = dataclasses.replace(micro, sequences=(*micro.sequences, seq))
        consumers = tuple(
            dataclasses.replace(c, micro_batches=(doubled, *c.micro_batches[1:]))
            if c is target
            else c
            for c in plan.consumers
        )
        bad = dataclasses.replace(plan, consumers=consumers)
        with pytest.raises(ValueError, match=repr(seq.trajectory_id)):
            store.register(bad)
    assert store.register(plan).minibatch_id == "mb0"


def test_multimodal_inputs_past_the_end_are_refused_by_the_planner() -> None:
    """Metadata whose multimodal input lies outside its trajectory's tokens (e.g. built by hand or
    by a rollout adapter) is refused before planning, naming the trajectory and the input."""
    (meta,) = make_metas([10])
    ref = MultimodalRef(UnitKey("abc", "image"), token_start=8, num_tokens=4)
    with pytest.raises(ValueError, match=r"'t0'.*abc/image.*\[8, 12\)"):
        plan_minibatch([dataclasses.replace(meta, multimodal=(ref,))], Topology(dp=1))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens_per_micro_batch", 0),
        ("max_tokens_per_micro_batch", -64),
        ("max_tokens_per_micro_batch", 0.5 - 1),
        ("encoder_max_cost_per_micro_batch", 0.0),
        ("min_micro_batches", 0),
        ("min_micro_batches", 1.5),
    ],
)
def test_budgets_are_checked_when_the_config_is_made(field: str, value: object) -> None:
    """A token or cost budget <= 0 (a zero one divided by zero) and a micro-batch count < 1 are
    refused by ``PlannerConfig`` itself, naming the field and the value."""
    with pytest.raises(ValueError, match=rf"{field}={value!r}"):
        PlannerConfig(**{field: value})


def test_registered_plans_survive_json() -> None:
    """The schema a registered plan carries round-trips through ``to_json`` / ``from_json``."""
    store = _store([30])
    plan = store.register(plan_for(store.metas(), Topology(dp=2), None, "mb0"))
    assert plan.consumers[1].row_specs["routing"] == ("uint8", (3, 2))
    assert MiniBatchPlan.from_json(plan.to_json()) == plan
    assert np.dtype(plan.consumers[0].row_specs["tokens"][0]) == np.int32
