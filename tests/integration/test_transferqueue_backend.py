"""TransferQueue adapter against the real transfer_queue package: unit backend and sample-level baseline."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("transfer_queue", reason="the transferqueue package is not installed")
pytest.importorskip("ray", reason="TransferQueue needs Ray to start")

from knitkit.integration.transferqueue.backend import (
    TransferQueueBackend,
    TransferQueueConnection,
    start_transfer_queue,
    stop_transfer_queue,
)
from knitkit.integration.transferqueue.baseline import put_trajectories, read_share_tq
from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.baselines.sample_level import RankPosition, pack_local, read_share
from knitkit.storage.baselines.synthetic import synthetic_trajectories
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer import Reorganizer
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.storage.planning.plan import Topology
from knitkit.storage.planning.planner import PlannerConfig, plan_minibatch
from knitkit.storage.units.store import TrajectoryStore
from knitkit.types import UnitKey

pytestmark = pytest.mark.slow
FIELDS = ("tokens", "logprobs", "loss_mask", "routing", "topp_mask")


@pytest.fixture(scope="module")
def connection() -> Iterator[TransferQueueConnection]:
    """One local Ray + TQ (one storage unit) for the module, shut down at the end."""
    made = start_transfer_queue()
    try:
        yield made
    finally:
        stop_transfer_queue()


@pytest.fixture
def backend(connection: TransferQueueConnection, request: pytest.FixtureRequest):
    made = TransferQueueBackend(connection, partition_id=f"units-{request.node.name}")
    yield made
    made.close()


def test_unit_rows_round_trip(backend: TransferQueueBackend):
    """Whole and sliced reads equal the stored array, for every dtype including 0-d scalars;
    bytes_read counts the whole unit TQ moved."""
    units = {
        UnitKey("t0", "routing"): np.arange(240, dtype=np.uint8).reshape(20, 6, 2),
        UnitKey("t0", "logprobs"): -np.linspace(0, 1, 20, dtype=np.float32),
        UnitKey("t0", "topp_mask"): np.arange(20) % 3 == 0,
        UnitKey("t0", "reward"): np.array(1.5, dtype=np.float32),
    }
    for key, array in units.items():
        backend.put(key, array)
    for key, array in units.items():
        assert backend.spec(key).shape == array.shape
        whole = backend.read(key)
        assert whole.dtype == array.dtype and np.array_equal(whole, array)
    before = backend.bytes_read
    routing = units[UnitKey("t0", "routing")]
    out = np.empty((5, 6, 2), dtype=np.uint8)
    backend.read(UnitKey("t0", "routing"), [(3, 5), (10, 13)], out=out)
    assert np.array_equal(out, np.concatenate([routing[3:5], routing[10:13]]))
    assert backend.bytes_read - before == routing.nbytes
    assert sorted(backend.keys()) == sorted(units)


def test_transfer_queue_actors_run_at_the_driver_s_niceness(
    connection: TransferQueueConnection,
) -> None:
    """NOTE [ Ray workers at the trainer's priority ] (integration/ray/runtime.py): the Ray
    runtime ``start_transfer_queue`` starts (``start_ray``) runs its workers, TQ's controller and
    storage units among them, at this process's niceness, not Ray's 15; at 15 they starved
    beside two busy loops (this module's start ran past pytest's 300 s). On 98c39b9: 15."""
    import os

    import psutil
    import ray

    mine = os.nice(0)
    task = ray.remote(lambda: os.nice(0)).remote()
    assert ray.get(task, timeout=120) == mine
    workers = {  # this machine's Ray processes by name (those of the module's probe too)
        p.info["name"]: p.nice()
        for p in psutil.process_iter(["name"])
        if (p.info["name"] or "").startswith("ray::")
    }
    assert {"ray::TransferQueueController", "ray::SimpleStorageUnit"} <= set(workers), workers
    assert set(workers.values()) == {mine}, workers


def test_contract_errors_leave_rows_unchanged(backend: TransferQueueBackend):
    """Duplicate put, unknown key, out-of-range read and a wrong-shape replace raise errors
    naming the key; the stored row is unchanged; a pickled copy reads the same rows."""
    key = UnitKey("t1", "tokens")
    tokens = np.arange(8, dtype=np.int64)
    backend.put(key, tokens)
    with pytest.raises(KeyError, match="t1/tokens"):
        backend.put(key, tokens + 1)
    with pytest.raises(KeyError, match="t9/tokens"):
        backend.read(UnitKey("t9", "tokens"))
    with pytest.raises(IndexError, match="t1/tokens"):
        backend.read(key, [(4, 9)])
    with pytest.raises(ValueError, match="t1/tokens"):
        backend.replace(key, np.arange(9, dtype=np.int64))
    assert np.array_equal(backend.read(key), tokens)
    backend.replace(key, tokens * 2)
    reader = pickle.loads(pickle.dumps(backend))
    try:
        assert np.array_equal(reader.read(key), tokens * 2)
    finally:
        reader.close()
    backend.delete(key)
    with pytest.raises(KeyError, match="t1/tokens"):
        backend.spec(key)


def test_sample_level_baseline_matches_local_packing(connection: TransferQueueConnection):
    """Each rank's DP share read from TQ rows packs into the same micro-batches as the
    sample-level read of knitkit's store; TP0/CP0 also receives every row's image copy."""
    trajectories = synthetic_trajectories(3, group_size=2, seed=5)
    store = TrajectoryStore(MemoryBackend())
    for trajectory in trajectories:
        store.write(trajectory)
    config = PlannerConfig(token_fields=FIELDS, max_tokens_per_micro_batch=300)
    plan = plan_minibatch(store.metas(), Topology(dp=2, cp=2, tp=2), config)
    client = connection.client()
    try:
        put_trajectories(client, trajectories, "trajectories")
        for rank in (RankPosition(0, 0, 0), RankPosition(1, 1, 1)):
            local, moved = read_share_tq(client, plan, rank, "trajectories")
            reference = read_share(store.backend, plan, rank)
            group = plan.consumer(rank.dp, rank.cp)
            for (layout, got), (_, expected) in zip(
                pack_local(group, local), pack_local(group, reference), strict=True
            ):
                views, wanted = layout.numpy_views(got), layout.numpy_views(expected)
                assert all(np.array_equal(views[n], wanted[n]) for n in wanted)
            images = sum(len(mb.sequences) for mb in group.micro_batches)
            image_bytes = trajectories[0].multimodal[0].data.nbytes
            own = sum(a.nbytes for k, a in reference.units.items() if k.field != "image")
            assert moved == own + (images * image_bytes if rank.reads_multimodal else 0)
    finally:
        client.close()


def test_store_over_transferqueue_delivers_like_memory(connection: TransferQueueConnection):
    """knitkit's logical store on TQ rows (one row per unit): the reorganizer loop delivers
    the same packed micro-batches as over the in-memory backend."""
    trajectories = synthetic_trajectories(2, group_size=2, seed=9)
    stores = {
        "tq": TrajectoryStore(TransferQueueBackend(connection, partition_id="store-units")),
        "memory": TrajectoryStore(MemoryBackend()),
    }
    delivered: dict[str, list[dict[str, np.ndarray]]] = {}
    try:
        for name, store in stores.items():
            for trajectory in trajectories:
                store.write(trajectory)
            config = PlannerConfig(token_fields=FIELDS, max_tokens_per_micro_batch=400)
            plan = plan_minibatch(store.metas(), Topology(dp=1, cp=2, tp=1), config)
            spec = RingSpec.new(num_slots=8, slot_bytes=1 << 20, num_consumers=1)
            owner = SlotRing.create(spec)
            publisher = Publisher(SlotRing.attach(spec))
            publisher.start()
            Reorganizer(store.backend, publisher).deliver("mb0", plan.consumer(0, 1))
            publisher.finish()
            with MicroBatchConsumer(spec, 0) as consumer:
                delivered[name] = [{k: v.copy() for k, v in b.fields.items()} for b in consumer]
            publisher.close()
            owner.close()
            owner.unlink()
    finally:
        for store in stores.values():
            store.backend.close()
    assert len(delivered["tq"]) == len(delivered["memory"]) > 0
    for got, expected in zip(delivered["tq"], delivered["memory"], strict=True):
        assert got.keys() == expected.keys()
        assert all(np.array_equal(got[k], expected[k]) for k in expected)


_STARTS = """
import time, ray
from knitkit.integration.ray import start_ray
from knitkit.integration.transferqueue import start_transfer_queue

started = time.monotonic()
try:
    start_transfer_queue(num_cpus=2)
except ValueError as error:
    print("REFUSED", round(time.monotonic() - started), error, flush=True)
else:
    print("STARTED", flush=True)
ray.shutdown()

start_ray(num_cpus=3)

@ray.remote(num_cpus=1)
class Hog:
    def ready(self):
        return True

hog = Hog.remote()
ray.get(hog.ready.remote())
started = time.monotonic()
try:
    start_transfer_queue(timeout_s=3)
except TimeoutError as error:
    print("TIMEOUT", round(time.monotonic() - started), error, flush=True)
else:
    print("STARTED", flush=True)
try:
    ray.get_actor("TransferQueueController", namespace="transfer_queue")
    print("LEFT controller", flush=True)
except ValueError:
    print("CLEAN", flush=True)
ray.shutdown()
"""


@pytest.fixture(scope="module", autouse=True)
def starts_probe() -> Iterator[subprocess.Popen[str]]:
    """The ``_STARTS`` process, started with the module: its own Ray runtimes (``start_ray``
    starts a new local one) run beside the module's TQ, so its ~25 s of starts and waits overlap
    the other tests instead of following them."""
    process = subprocess.Popen(
        [sys.executable, "-c", _STARTS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.fixture(scope="module")
def start_outcomes(starts_probe: subprocess.Popen[str]) -> list[str]:
    """Two starts that must not succeed, in one fresh process (Ray and TQ imported once): 2
    logical CPUs in all, then 3 with one held by another actor; stdout, a line per outcome."""
    try:
        stdout, stderr = starts_probe.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        pytest.fail("start_transfer_queue did not return within 400 s (two starts)")
    assert starts_probe.returncode == 0, stderr[-3000:]
    return stdout.splitlines()


def test_too_few_cpus_for_transfer_queue_is_refused_at_once(start_outcomes: list[str]) -> None:
    """``start_transfer_queue(num_cpus=2)``: TQ's controller and two storage units need 3
    logical CPUs, so it would wait forever; it is refused at once, naming the CPUs and the fix
    (the bound here covers Ray's own start on a loaded machine)."""
    out = start_outcomes[0]
    assert out.startswith("REFUSED"), start_outcomes
    assert "needs 3 logical CPUs" in out and "num_cpus=3" in out


def test_a_start_that_cannot_be_placed_times_out_and_cleans_up(start_outcomes: list[str]) -> None:
    """Enough CPUs in the cluster but one held by another actor: the start gives up after
    ``timeout_s`` with a ``TimeoutError`` naming the free CPUs, and kills what it started (3 s:
    the start can never be placed, so a loaded machine only makes the wait longer)."""
    timeout, cleanup = start_outcomes[1:3]
    assert timeout.startswith("TIMEOUT") and "free logical CPUs" in timeout, start_outcomes
    assert 3 <= int(timeout.split()[1]) < 200, start_outcomes
    assert cleanup == "CLEAN", start_outcomes


def test_write_ranges_goes_through_whole_unit_replace(backend: TransferQueueBackend):
    """TQ rewrites whole rows only: ``write_ranges`` (the Protocol's default) reads the unit,
    pastes the rows and replaces it; the other rows are unchanged."""
    key = UnitKey("t-wr", "logprobs")
    backend.put(key, np.arange(10, dtype=np.float32))
    backend.write_ranges(key, [(2, 4), (8, 9)], np.array([-1, -2, -3], dtype=np.float32))
    np.testing.assert_array_equal(backend.read(key), [0, 1, -1, -2, 4, 5, 6, 7, -3, 9])
    with pytest.raises(IndexError, match="t-wr/logprobs"):
        backend.write_ranges(key, [(9, 11)], np.zeros(2, dtype=np.float32))
