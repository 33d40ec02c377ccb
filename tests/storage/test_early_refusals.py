"""Bad layouts, backends and plans are refused where they are made, naming the culprit, not deep
inside the planner or a reorganizer (issue 22, items 11 and 18)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from knitkit.storage import (
    EncoderTopology,
    MemoryBackend,
    PlannerConfig,
    Topology,
    Trajectory,
    TrajectoryStore,
    plan_minibatch,
)
from knitkit.storage.backends import UnitBackend, UnitSpec, check_backend
from knitkit.storage.backends.backend import PROTOCOL_MEMBERS
from knitkit.types import SeqRange, UnitKey


@pytest.mark.parametrize(
    "make",
    [
        lambda: Topology(dp=0),
        lambda: Topology(dp=-3, tp=0),
        lambda: Topology(dp=2, cp=0),
        lambda: Topology(dp=1.5),  # type: ignore[arg-type]
        lambda: Topology(dp=True),
        lambda: Topology(dp=1, sequence_parallel="yes"),  # type: ignore[arg-type]
        lambda: EncoderTopology("vision", dp=0),
        lambda: EncoderTopology("vision", dp=-3, tp=0),
        lambda: EncoderTopology("vision", dp=2, tp=0),
        lambda: EncoderTopology("vision", dp=2.0),  # type: ignore[arg-type]
        lambda: EncoderTopology("", dp=1),
        lambda: EncoderTopology("a/b", dp=1),
        lambda: EncoderTopology("vision", dp=1, kinds=()),
        lambda: EncoderTopology("vision", dp=1, kinds="image"),  # type: ignore[arg-type]
    ],
)
def test_layouts_are_validated_at_construction(make) -> None:
    """Every parallel size is an int >= 1 and every name usable, checked when the value is made
    (a ``ValueError`` naming the field), never deep inside karmarkar_karp."""
    with pytest.raises(ValueError, match=r"Topology"):
        make()


def test_two_encoders_of_one_name_are_refused() -> None:
    """Encoders name their consumers; two of one name would share consumer names."""
    with pytest.raises(ValueError, match="'vision'"):
        plan_minibatch(
            [], Topology(dp=1), PlannerConfig(), (EncoderTopology("vision", 1),) * 2, "mb"
        )


def test_planner_fields_must_be_tuples_of_names() -> None:
    """A bare string for ``token_fields`` would be read as one field per character."""
    with pytest.raises(TypeError, match="token_fields"):
        plan_minibatch([], Topology(dp=1), PlannerConfig(token_fields="tokens"))  # type: ignore[arg-type]


class _Wrapper:
    """A backend that matches the Protocol's core methods without subclassing it."""

    def __init__(self) -> None:
        self.inner = MemoryBackend()

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        self.inner.put(key, array)

    def replace(self, key: UnitKey, array: np.ndarray) -> None:
        self.inner.replace(key, array)

    def spec(self, key: UnitKey) -> UnitSpec:
        return self.inner.spec(key)

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        return self.inner.read(key, ranges, out)

    def delete(self, key: UnitKey) -> None:
        self.inner.delete(key)

    def keys(self) -> Iterator[UnitKey]:
        return self.inner.keys()

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    def close(self) -> None:
        self.inner.close()


def test_a_backend_missing_protocol_members_is_refused_when_the_store_is_built() -> None:
    """A wrapper that implements the Protocol without subclassing it lacks ``read_many`` (and
    the other defaults): building a store over it raises ``TypeError`` naming every missing
    member and the fix, instead of failing later inside a reorganizer; a subclass inherits
    the defaults and is accepted."""
    with pytest.raises(TypeError, match=r"_Wrapper .*'read_many'.*'write_ranges'.*subclass"):
        TrajectoryStore(_Wrapper())  # type: ignore[arg-type]

    class Subclassed(_Wrapper, UnitBackend):
        pass

    store = TrajectoryStore(Subclassed())
    store.close()


def test_protocol_members_list_every_member_of_the_protocol() -> None:
    """``check_backend`` looks for exactly the Protocol's members."""
    members = {n for n in vars(UnitBackend) if not n.startswith("_")}
    assert set(PROTOCOL_MEMBERS) == members
    check_backend(MemoryBackend())


def _trajectory(tid: str, *, logprobs: bool) -> Trajectory:
    fields = {"tokens": np.arange(8, dtype=np.int32), "loss_mask": np.ones(8, dtype=bool)}
    if logprobs:
        fields["logprobs"] = np.zeros(8, dtype=np.float32)
    return Trajectory(tid, f"s-{tid}", fields, {"reward": np.float32(1.0)})


def test_a_plan_packing_a_field_some_trajectories_lack_is_refused_at_registration() -> None:
    """Trajectories with and without ``logprobs`` planned together with ``logprobs`` among the
    packed fields: ``register`` refuses (``ValueError``) naming the field, EVERY trajectory that
    lacks it and one that has it, before any change (the mini-batch is not registered); a plan
    without the field registers."""
    store = TrajectoryStore(MemoryBackend())
    store.write(_trajectory("with", logprobs=True))
    store.write(_trajectory("without", logprobs=False))
    store.write(_trajectory("without-too", logprobs=False))
    config = PlannerConfig(token_fields=("tokens", "logprobs", "loss_mask"))
    plan = plan_minibatch(store.metas(), Topology(dp=2), config, (), "mb0")
    with pytest.raises(ValueError) as refused:
        store.register(plan)
    message = str(refused.value)
    assert re.search(r"'logprobs'.*2 of 3 trajectories lack it.*'without', 'without-too'", message)
    assert "'with'" in message, message
    assert store.metrics()["knitkit/storage/minibatches_registered"] == 0
    fine = PlannerConfig(token_fields=("tokens", "loss_mask"))
    store.register(plan_minibatch(store.metas(), Topology(dp=2), fine, (), "mb0"))
    store.close()


def test_a_declared_write_back_field_may_be_registered_before_it_is_written() -> None:
    """A field declared for write-back (a forward-only pass produces it) may be packed by a
    registered plan before any trajectory has it; an undeclared missing field may not."""
    store = TrajectoryStore(MemoryBackend())
    store.write(_trajectory("a", logprobs=False))
    store.declare_field("old_logprobs", "float32")
    config = PlannerConfig(token_fields=("tokens", "old_logprobs"))
    plan = store.register(plan_minibatch(store.metas(), Topology(dp=1), config, (), "mb0"))
    assert {f.name: (f.dtype, f.shape) for f in plan.consumers[0].schema}["old_logprobs"] == (
        "float32",
        (),
    )
    assert not store.field_complete("a", "old_logprobs")
    store.close()
