"""knitkit.integration.mooncake against a real mooncake_master on 127.0.0.1 (the contract suite
in tests/storage runs the same backend too)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

try:
    import mooncake.store  # noqa: F401
except ImportError as error:  # the wheel, or a system library it links (libibverbs1, libnuma1)
    pytest.skip(
        f"Mooncake cannot load: {error} (needs mooncake-transfer-engine-non-cuda and, installed "
        "as root, libibverbs1 libnuma1: ./dev.sh test as root installs them)",
        allow_module_level=True,
    )

from knitkit.integration.mooncake import MasterAddress, MooncakeBackend, MooncakeMaster
from knitkit.storage import PlannerConfig, Topology, TrajectoryStore, plan_minibatch
from knitkit.storage.baselines.synthetic import synthetic_trajectories
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingSpec
from knitkit.types import UnitKey, UnitRead

POSITION_MASK = (1 << 20) - 1


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterAddress]:
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    with MooncakeMaster(log_path=str(log)) as address:
        yield address


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeBackend]:
    """One client for the module's ``backend`` tests (a close costs 2-3 s: NOTE [ Namespaces on
    one client ] in integration/mooncake/backend.py), on a master of its own: its segment would
    take replicas of the units that the tests on ``master`` put through their own clients."""
    log = tmp_path_factory.mktemp("mooncake") / "client_master.log"
    with MooncakeMaster(log_path=str(log)) as address:
        made = MooncakeBackend(address, segment_bytes=128 << 20, allow_wildcard_listeners=True)
        try:
            yield made
        finally:
            made.close()


@pytest.fixture
def backend(client: MooncakeBackend) -> Iterator[MooncakeBackend]:
    """A fresh namespace on the module's client; its close removes the namespace's units."""
    made = client.with_namespace()
    try:
        yield made
    finally:
        made.close()


def _segments(master: MasterAddress) -> list[str]:
    """The segments mounted at the master (one per client that contributes memory)."""
    with urllib.request.urlopen(f"http://{master.http}/get_all_segments", timeout=10) as reply:
        return reply.read().decode().split()


def test_namespaces_on_one_client_are_separate_and_the_last_close_disconnects(
    master: MasterAddress,
) -> None:
    """``with_namespace`` serves another namespace through the same client: the same key holds
    each namespace's own rows, listed only there, read straight out of the shared segment; a
    namespace's close removes its units alone and leaves the client (its segment) up for the
    others, whichever closes first; the last close unmounts the segment; a closed backend
    refuses to make another."""
    key = UnitKey("t0", "tokens")
    before = set(_segments(master))
    first = MooncakeBackend(master, segment_bytes=16 << 20, allow_wildcard_listeners=True)
    second = first.with_namespace()
    third = second.with_namespace("knitkit-named")
    mounted = set(_segments(master)) - before
    try:
        assert len(mounted) == 1  # one client, one segment
        assert len({first.namespace, second.namespace, third.namespace}) == 3
        assert third.namespace == "knitkit-named"
        for value, backend in enumerate((first, second, third)):
            backend.put(key, np.full(8, value, dtype=np.int32))
        for value, backend in enumerate((first, second, third)):
            np.testing.assert_array_equal(backend.read(key, [(2, 5)]), [value] * 3)
            assert list(backend.keys()) == [key]
            assert backend.bytes_read_locally == backend.bytes_read == 12
        first.close()  # the creator first: the others keep the client
        first.close()  # a second close changes nothing
        with pytest.raises(RuntimeError, match=first.namespace):
            first.with_namespace()
        assert set(_segments(master)) - before == mounted
        np.testing.assert_array_equal(second.read(key), np.full(8, 1, dtype=np.int32))
        second.close()
        again = third.with_namespace(second.namespace)
        try:
            with pytest.raises(KeyError, match="t0/tokens"):
                again.read(key)  # second's units went with its close
        finally:
            again.close()
        np.testing.assert_array_equal(third.read(key), np.full(8, 2, dtype=np.int32))
    finally:
        for backend in (first, second, third):
            backend.close()
    assert set(_segments(master)) - before == set()


def test_ranged_reads_move_only_the_asked_rows(backend: MooncakeBackend) -> None:
    """Several ranges of a routing unit [seq, 48, 8] come back in order; bytes_read counts only them."""
    routing = np.random.default_rng(0).integers(0, 64, (4096, 48, 8), dtype=np.uint8)
    key = UnitKey("t0", "routing")
    backend.put(key, routing)
    ranges = [(100, 612), (4000, 4096), (0, 3)]
    got = backend.read(key, ranges)
    np.testing.assert_array_equal(got, np.concatenate([routing[a:b] for a, b in ranges]))
    assert backend.bytes_read == (512 + 96 + 3) * 48 * 8


def _read_in_child(backend: MooncakeBackend, key: UnitKey, results: mp.Queue) -> None:
    try:
        results.put(backend.read(key, [(2, 5)]).tolist())
    finally:
        backend.close()


def test_a_pickled_backend_reads_from_another_process(backend: MooncakeBackend) -> None:
    """A spawned process gets a client of the same namespace (no memory of its own) and reads ranges."""
    key = UnitKey("t1", "logprobs")
    backend.put(key, np.arange(10, dtype=np.float32))
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(backend, key, results))
    child.start()
    assert results.get(timeout=60) == [2.0, 3.0, 4.0]
    child.join(30)
    assert child.exitcode == 0


def test_reads_into_a_registered_buffer_reuse_it(backend: MooncakeBackend) -> None:
    """Reads into views of one registered buffer (a reorganizer's ring) land at the right offsets."""
    key = UnitKey("t2", "tokens")
    backend.put(key, np.arange(1000, dtype=np.int64))
    ring = np.zeros(64, dtype=np.int64)
    backend.register(ring)
    backend.read(key, [(10, 20)], out=ring[:10])
    backend.read(key, [(990, 1000), (0, 2)], out=ring[32:44])
    np.testing.assert_array_equal(ring[:10], np.arange(10, 20))
    np.testing.assert_array_equal(ring[32:44], [*range(990, 1000), 0, 1])
    assert not ring[10:32].any() and not ring[44:].any()


def _routing_units(count: int, seed: int) -> dict[UnitKey, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        UnitKey(f"local-{seed}-{i}", "routing"): rng.integers(
            0, 64, (int(rng.integers(1, 3000)), 48, 8), dtype=np.uint8
        )
        for i in range(count)
    }


def _random_ranges(rng: np.random.Generator, rows: int) -> tuple[tuple[int, int], ...]:
    """Sorted, disjoint, possibly empty ranges within ``rows``."""
    cuts = np.sort(rng.integers(0, rows + 1, 2 * int(rng.integers(1, 4))))
    return tuple((int(a), int(b)) for a, b in zip(cuts[::2], cuts[1::2], strict=True))


def _read_all(
    backend: MooncakeBackend,
    units: dict[UnitKey, np.ndarray],
    seed: int,
    columns: tuple[int, int] | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One ``read_many`` of random ranges (x ``columns``) of every unit: (what came back, what
    slicing gives)."""
    rng = np.random.default_rng(seed)
    reads = [
        UnitRead(key, _random_ranges(rng, unit.shape[0]), columns) for key, unit in units.items()
    ]
    axis1 = slice(None) if columns is None else slice(*columns)
    wants = [np.concatenate([units[r.key][a:b, axis1] for a, b in r.ranges or ()]) for r in reads]
    outs = [np.full_like(want, 255) for want in wants]
    backend.read_many(reads, outs)
    return outs, wants


def test_an_owner_reads_ranges_of_its_own_units_without_the_transport(
    master: MasterAddress,
) -> None:
    """Units whose replica lies in this client's own segment are read by a copy out of it (as
    Mooncake's own same-process LOCAL_MEMCPY does for whole objects): every range (and a
    pipeline stage's layers of it, ``UnitRead.columns``) equals slicing the unit and every byte
    counts in ``bytes_read_locally``; a memory-less client of the same namespace reads the same
    over the transport (``bytes_read_locally`` stays 0): layers staged from whole rows, and
    columns of rows whose other columns are long (past ``_FRAGMENT_GAP``) a fragment per row."""
    owner = MooncakeBackend(master, segment_bytes=64 << 20, allow_wildcard_listeners=True)
    reader = MooncakeBackend(
        master, namespace=owner.namespace, segment_bytes=0, allow_wildcard_listeners=True
    )
    try:
        units = _routing_units(6, seed=1)
        wide = {UnitKey("wide", "x"): np.arange(5 * 300 * 1024, dtype=np.uint8).reshape(5, 300, -1)}
        for key, unit in (units | wide).items():
            owner.put(key, unit)
        for backend in (owner, reader):
            moved = 0
            for chosen, columns in ((units, None), (units, (10, 34)), (wide, (5, 7))):
                got, want = _read_all(backend, chosen, seed=2, columns=columns)
                for out, expected in zip(got, want, strict=True):
                    np.testing.assert_array_equal(out, expected)
                moved += sum(w.nbytes for w in want)
            assert backend.bytes_read == moved
        assert owner.bytes_read_locally == owner.bytes_read
        assert reader.bytes_read_locally == 0
    finally:
        reader.close()
        owner.close()


def test_one_batch_reads_local_and_remote_replicas_alike(master: MasterAddress) -> None:
    """Two clients contribute memory to one namespace, so a batch's replicas lie partly in the
    reader's own segment and partly in the other's: one ``read_many`` copies the first, moves
    the second over the transport, and every range equals slicing the unit."""
    first = MooncakeBackend(master, segment_bytes=64 << 20, allow_wildcard_listeners=True)
    second = MooncakeBackend(
        master, namespace=first.namespace, segment_bytes=64 << 20, allow_wildcard_listeners=True
    )
    try:
        units = _routing_units(16, seed=3)
        for key, unit in units.items():
            first.put(key, unit)
        got, want = _read_all(first, units, seed=4)
        for out, expected in zip(got, want, strict=True):
            np.testing.assert_array_equal(out, expected)
        assert first.bytes_read == sum(w.nbytes for w in want)
        assert 0 < first.bytes_read_locally < first.bytes_read
    finally:
        second.close()
        first.close()


def test_closing_the_owner_removes_its_units(master: MasterAddress) -> None:
    """The owning client's close() removes every unit of its namespace from the store."""
    owner = MooncakeBackend(master, segment_bytes=32 << 20, allow_wildcard_listeners=True)
    owner.put(UnitKey("t3", "tokens"), np.arange(5, dtype=np.int32))
    reader = MooncakeBackend(
        master, namespace=owner.namespace, segment_bytes=0, allow_wildcard_listeners=True
    )
    try:
        assert list(reader.keys()) == [UnitKey("t3", "tokens")]
        owner.close()
        assert list(reader.keys()) == []
        with pytest.raises(KeyError, match="t3/tokens"):
            reader.read(UnitKey("t3", "tokens"))
    finally:
        reader.close()


def test_a_reorganizer_process_delivers_from_mooncake(backend: MooncakeBackend) -> None:
    """The real reorganizer loop, in a spawned process reading Mooncake, delivers every token of a
    CP=2 plan exactly once."""
    trajectories = synthetic_trajectories(2, group_size=2, max_tokens=300)
    store = TrajectoryStore(backend)
    for trajectory in trajectories:
        store.write(trajectory)
    config = PlannerConfig(token_fields=("tokens", "routing"), scalar_fields=("reward",))
    plan = plan_minibatch(
        store.metas([t.trajectory_id for t in trajectories]),
        Topology(1, 2),
        config,
        minibatch_id="mb0",
    )
    seen: list[int] = []
    for group in plan.consumers:
        spec = RingSpec.new(num_slots=1, slot_bytes=1 << 20, num_consumers=1)
        with ReorganizerProcess(backend, spec) as reorganizer:
            reorganizer.submit(plan.minibatch_id, group)
            reorganizer.finish(timeout_s=0)
            with MicroBatchConsumer(spec, 0, liveness_timeout_s=30) as consumer:
                for mb in consumer:
                    tokens = mb.fields["tokens"]
                    seen += tokens[(tokens & POSITION_MASK) == mb.fields["position_ids"]].tolist()
                    mb.release()  # a lease: the 1-slot ring is refilled only after it
    everything = np.concatenate([t.token_fields["tokens"] for t in trajectories])
    assert sorted(seen) == sorted(everything.tolist())


def test_the_master_stops_and_frees_its_port(tmp_path: Path) -> None:
    """stop() ends the master process; its RPC port accepts a new bind afterwards."""
    master = MooncakeMaster(log_path=str(tmp_path / "master.log"))
    address = master.start()
    MooncakeBackend(address, segment_bytes=16 << 20, allow_wildcard_listeners=True).close()
    master.stop()
    host, port = address.rpc.rsplit(":", 1)
    with socket.socket() as sock:
        sock.bind((host, int(port)))
    master.stop()  # idempotent


@pytest.mark.parametrize(
    "spelling", ["LOCALHOST", "localhost.", "ip6-localhost", "0:0:0:0:0:0:0:1", "127.1"]
)
def test_every_spelling_of_loopback_needs_the_wildcard_opt_in(
    master: MasterAddress, spelling: str
) -> None:
    """The wildcard-listener guard decides on the resolved address: a loopback
    ``local_hostname`` however spelled refuses to start without ``allow_wildcard_listeners``,
    before any engine listens (issue 22, item 9)."""
    if spelling == "ip6-localhost":
        try:
            socket.getaddrinfo(spelling, None)
        except socket.gaierror:
            pytest.skip("ip6-localhost is not in this host's /etc/hosts, so nothing resolves it")
    try:
        made = MooncakeBackend(master, segment_bytes=0, local_hostname=spelling)
    except ValueError as error:
        assert "allow_wildcard_listeners=True" in str(error)
    else:
        made.close()
        pytest.fail(f"local_hostname={spelling!r} started wildcard listeners without the opt-in")


def test_a_local_hostname_that_does_not_resolve_is_refused(master: MasterAddress) -> None:
    """A ``local_hostname`` that does not resolve is a ``ValueError`` naming it, at once."""
    with pytest.raises(ValueError, match=r"no-such-host\.invalid"):
        MooncakeBackend(master, segment_bytes=0, local_hostname="no-such-host.invalid")
