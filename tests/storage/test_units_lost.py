"""Lost units reach the trainer typed and named on every path: pickled across processes and Ray,
through a reorganizer's ring to its consumer, and on every later read (issue 22, item 8)."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from knitkit.storage import (
    MicroBatchConsumer,
    PlannerConfig,
    ReorganizerError,
    ReorganizerProcess,
    RingSpec,
    SharedMemoryBackend,
    Topology,
    TrajectoryStore,
    plan_minibatch,
)
from knitkit.storage.backends import UnitsLostError, lost_units_in
from knitkit.storage.baselines import synthetic_trajectories
from knitkit.types import UnitKey

WAIT_S = 120
FIELDS = ("tokens", "logprobs", "loss_mask")


def test_units_lost_error_pickles_with_its_keys() -> None:
    """The error crosses any pickling boundary (a process, a Ray task) with its type, keys, and
    message intact; its message names the keys so text that crossed a ring parses back."""
    keys = (UnitKey("t0", "tokens"), UnitKey("abc123", "image"))
    error = UnitsLostError(keys, "Ray unit directory 'd'", "their owner died")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is UnitsLostError and again.keys == keys and str(again) == str(error)
    assert lost_units_in(f"Traceback (most recent call last):\n  ...\n{error!r}\n") == keys
    assert lost_units_in("KeyError: unknown unit t0/tokens") == ()
    cut = str(error)[: str(error).index("abc123")]  # a ring keeps only an error's first bytes
    assert lost_units_in(cut) == keys[:1]


def _store_with_one_slab(tmp_path) -> tuple[TrajectoryStore, list[str]]:
    store = TrajectoryStore(SharedMemoryBackend(slab_bytes=4 << 20, directory=str(tmp_path)))
    ids = []
    for trajectory in synthetic_trajectories(num_samples=2, group_size=2, max_tokens=200):
        store.write(trajectory)
        ids.append(trajectory.trajectory_id)
    return store, ids


def test_a_reorganizer_that_meets_lost_units_makes_its_consumer_raise_them(tmp_path) -> None:
    """A slab is shrunk under a running reorganizer process (its units are lost) between two
    mini-batches: the consumer raises an error that is both a ``ReorganizerError`` and a
    ``UnitsLostError`` whose ``keys`` name lost units the plan reads, not a bare text or an
    unknown-unit ``KeyError``."""
    store, ids = _store_with_one_slab(tmp_path)
    config = PlannerConfig(token_fields=FIELDS, scalar_fields=("reward",))
    plans = [
        store.register(plan_minibatch(store.metas(part), Topology(dp=1), config, (), name))
        for name, part in (("mb0", ids[:2]), ("mb1", ids[2:]))
    ]
    spec = RingSpec.new(num_slots=2, slot_bytes=8 << 20, num_consumers=1)
    backend = store.backend
    assert isinstance(backend, SharedMemoryBackend)
    with ReorganizerProcess(backend, spec) as reorganizer:
        reorganizer.submit("mb0", plans[0].consumer(0, 0))
        with MicroBatchConsumer(spec, 0) as consumer:
            for _ in range(plans[0].num_micro_batches):
                consumer.next_micro_batch(timeout_s=WAIT_S).release()
            with open(backend.paths[0], "r+b") as slab:
                slab.truncate(4096)
            reorganizer.submit("mb1", plans[1].consumer(0, 0))
            with pytest.raises(UnitsLostError) as raised:
                consumer.next_micro_batch(timeout_s=WAIT_S)
    assert isinstance(raised.value, ReorganizerError)
    read = {r.key for r in plans[1].consumer(0, 0).reads()}
    assert read & set(raised.value.keys)
    store.close()


def test_a_direct_store_read_and_registration_name_the_lost_units(tmp_path) -> None:
    """After a slab was shrunk, a store read and the registration of a plan reading its units
    raise ``UnitsLostError`` naming them (never a SIGBUS or a 'never put' ``KeyError``)."""
    store, ids = _store_with_one_slab(tmp_path)
    backend = store.backend
    assert isinstance(backend, SharedMemoryBackend)
    with open(backend.paths[0], "r+b") as slab:
        slab.truncate(4096)
    with pytest.raises(UnitsLostError) as raised:
        store.read(UnitKey(ids[-1], "tokens"))
    assert UnitKey(ids[-1], "tokens") in raised.value.keys
    store.close()


# ----------------------------------------------------------------------------- Ray


ray = pytest.importorskip("ray", reason="the Ray paths need ray (pip install knitkit[ray])")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402
from ray_cluster import local_cluster  # noqa: E402

from knitkit.integration.ray import RayBackend, ReorganizerActor, loopback_only  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A real local Ray cluster (one head node; tests add and remove a worker node)."""
    with local_cluster() as made:
        yield made


@ray.remote(num_cpus=0)
class _Writer:
    def __init__(self, backend: RayBackend) -> None:
        self.backend = backend

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        self.backend.put(key, array)


@ray.remote(num_cpus=0)
def _read(backend: RayBackend, key: UnitKey) -> np.ndarray:
    return backend.read(key)


def _lose(cluster: Cluster, backend: RayBackend, keys: list[UnitKey]) -> None:
    """Put ``keys`` from an actor on a node of their own, then remove that node."""
    with loopback_only():
        node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
    writer = _Writer.options(scheduling_strategy=strategy).remote(backend)
    ray.get([writer.put.remote(k, np.arange(16, dtype=np.int32)) for k in keys])
    cluster.remove_node(node)


def test_a_ray_task_that_meets_lost_units_raises_them_typed(cluster: Cluster) -> None:
    """A task reading a unit whose owner's node died: the driver's ``ray.get`` raises a
    ``UnitsLostError`` with ``.keys`` (not an ``UnserializableException``); every later reader,
    in another task or the driver, gets ``UnitsLostError`` too (never 'never put'); deleting the
    lost unit (the store releasing its trajectory) forgets it."""
    backend = RayBackend()
    try:
        lost = UnitKey("t-remote", "tokens")
        _lose(cluster, backend, [lost])
        for _ in range(2):  # the first reader finds the loss, the second is told by the directory
            with pytest.raises(UnitsLostError) as raised:
                ray.get(_read.remote(backend, lost))
            assert raised.value.keys == (lost,)
        with pytest.raises(UnitsLostError) as raised:
            backend.read(lost)
        assert raised.value.keys == (lost,)
        assert lost not in set(backend.keys())
        backend.delete(lost)
        with pytest.raises(KeyError, match="never put"):
            backend.read(lost)
    finally:
        backend.close()


def test_a_store_and_a_reorganizer_actor_report_lost_units_typed(cluster: Cluster) -> None:
    """A registered mini-batch whose unit is then lost with its owner's node: the reorganizer
    actor delivering it fails with ``UnitsLostError`` naming the unit (``ray.get`` on its
    ``deliver``), and registering another plan of those trajectories raises it too, never a
    ``KeyError`` saying the unit was never put; aborting the mini-batch frees the lost unit."""
    backend = RayBackend()
    store = TrajectoryStore(backend)
    try:
        trajectories = synthetic_trajectories(num_samples=1, group_size=2, max_tokens=64)
        for trajectory in trajectories:
            store.write(trajectory)
        ids = [t.trajectory_id for t in trajectories]
        config = PlannerConfig(token_fields=FIELDS, scalar_fields=("reward",))
        plan = store.register(plan_minibatch(store.metas(ids), Topology(dp=1), config, (), "a"))
        lost = UnitKey(ids[0], "logprobs")
        backend.delete(lost)  # swap the unit for one whose owner's node then dies
        _lose(cluster, backend, [lost])
        spec = RingSpec.new(num_slots=2, slot_bytes=4 << 20, num_consumers=1)
        actor = ReorganizerActor.remote(backend, spec)
        try:
            with pytest.raises(UnitsLostError) as raised:
                ray.get(actor.deliver.remote("a", plan.consumer(0, 0)), timeout=WAIT_S)
            assert raised.value.keys == (lost,)
        finally:
            ray.get(actor.close.remote())
        again = plan_minibatch(store.metas(ids), Topology(dp=1), config, (), "b")
        with pytest.raises(UnitsLostError) as raised:
            store.register(again)
        assert raised.value.keys == (lost,)
        store.abort("a")
        assert not any(k.owner in ids for k in list(backend.keys()))
    finally:
        store.close()
