"""Assignments pickle as columns of plain values: the same plans back, with a number of Python
calls that does not grow with the plan (NOTE [ Plans pickled as columns ])."""

from __future__ import annotations

import pickle

import pytest
from call_count import python_calls

from knitkit.storage.planning.plan import (
    ConsumerPlan,
    EncoderRankPlan,
    EncoderTopology,
    MiniBatchPlan,
    StageLayers,
    Topology,
)
from knitkit.storage.planning.planner import PlannerConfig, plan_minibatch
from knitkit.types import MultimodalRef, TrajectoryMeta, UnitKey

ENCODER = EncoderTopology("vision", dp=2)


def _plan(trajectories: int, *, dp: int = 2, cp: int = 2) -> MiniBatchPlan:
    """A plan of ``trajectories`` (two per sample, each sample's image shared by its pair), with
    the fields' schema and two pipeline stages' layers of ``routing``."""
    metas = []
    for i in range(trajectories):
        image = UnitKey(f"img{i // 2}", "image")
        refs = (MultimodalRef(image, 0, 16, 16.0),) if i % 3 else ()
        metas.append(TrajectoryMeta(f"t{i}", f"s{i // 2}", "src", 0, 40 + 7 * i, 0, 0, True, refs))
    config = PlannerConfig(
        token_fields=("tokens", "routing"),
        scalar_fields=("reward",),
        max_tokens_per_micro_batch=200,
        stage_layers=StageLayers(((0, 2), (2, 4)), ("routing",)),
    )
    plan = plan_minibatch(metas, Topology(dp=dp, cp=cp), config, (ENCODER,), "mb")
    return plan.with_schema(
        {"tokens": ("int32", ()), "routing": ("uint8", (4, 2)), "reward": ("float32", ())}
    )


def _assignments(plan: MiniBatchPlan) -> list[ConsumerPlan | EncoderRankPlan]:
    return [*plan.consumers, *plan.stage_consumers(2), *plan.encoder("vision").ranks]


@pytest.mark.parametrize("trajectories", [0, 1, 9, 40])
def test_assignments_come_back_equal(trajectories: int) -> None:
    """Every consumer's and encoder rank's assignment, with multimodal refs, stage columns, a
    schema and idle DP ranks (fewer trajectories than ranks), unpickles equal, field by field,
    with the same types (tuples stay tuples)."""
    plan = _plan(trajectories, dp=4 if trajectories == 1 else 2)
    assignments = _assignments(plan)
    assert any(not mb.sequences for c in plan.consumers for mb in c.micro_batches) or trajectories
    for assignment in assignments:
        back = pickle.loads(pickle.dumps(assignment))
        assert back == assignment
        assert repr(back) == repr(assignment)
        if isinstance(back, ConsumerPlan):
            assert isinstance(back.micro_batches, tuple)
            for mb in back.micro_batches:
                assert isinstance(mb.sequences, tuple)
                assert all(isinstance(s.multimodal, tuple) for s in mb.sequences)
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_unpickling_an_assignment_runs_no_python_per_object() -> None:
    """A reorganizer unpickles each assignment before its first copy: the Python frames it runs
    do not grow with the plan's sequences, references and micro-batches (dataclasses' pickling
    ran ``__setstate__`` and ``fields()`` per object: ~2 frames per object, 5 objects per
    sequence with an image)."""
    small, large = _plan(4, dp=1, cp=1), _plan(64, dp=1, cp=1)
    (few,), (many,) = small.consumers, large.consumers
    assert sum(len(mb.sequences) for mb in many.micro_batches) == 64
    assert len(many.micro_batches) > len(few.micro_batches)
    blobs = [pickle.dumps(c) for c in (few, many)]
    ranks = [pickle.dumps(p.encoder("vision").ranks[0]) for p in (small, large)]
    for blob in (*blobs, *ranks):  # first loads fill caches (imports, slot setters)
        pickle.loads(blob)
    calls = [python_calls(lambda blob=blob: pickle.loads(blob)) for blob in blobs]
    assert calls[0] == calls[1] and calls[1] <= 20, calls
    calls = [python_calls(lambda blob=blob: pickle.loads(blob)) for blob in ranks]
    assert calls[0] == calls[1] and calls[1] <= 10, calls
