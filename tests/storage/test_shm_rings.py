"""Slot rings across pid namespaces and after kills: liveness is the role lock, not the pid; what a
killed job leaves is swept by the next one; a reorganizer leaves no named semaphores (issue 30,
items 10, 11, 14)."""

from __future__ import annotations

import os
import signal

from shm_processes import python, unshare_pid

from knitkit.storage.backends.segments import sweep_dead_segments
from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing, unlink_ring
from knitkit.types import MicroBatchLayout

WAIT_S = 120


_RING_OWNER = """
    import sys
    from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
    ring = SlotRing.create(RingSpec.new(num_slots=1, slot_bytes=4096, num_consumers=1))
    print(ring.spec.name, flush=True)
    sys.stdin.readline()
"""


def test_a_live_ring_survives_other_namespaces_and_a_killed_ones_is_swept(shm_dir: str) -> None:
    """A ring whose owner lives is kept by ``knitkit shm-clean`` run in a second pid namespace
    (where the owner's pid means nothing); once its owner is SIGKILLed (nothing of it ran), the
    next job's start-up sweep (a ``SharedMemoryBackend``) removes it."""
    prefix = unshare_pid()
    owner = python(_RING_OWNER)
    name = ""
    try:
        assert owner.stdout is not None
        name = owner.stdout.readline().strip()
        assert name, owner.stderr.read() if owner.stderr else ""
        os.link(f"/dev/shm/{name}", os.path.join(shm_dir, name))
        clean = python(
            f"from knitkit.cli import main; main(['shm-clean', '--directory', {shm_dir!r}])",
            *prefix,
        )
        out, err = clean.communicate(timeout=WAIT_S)
        assert clean.returncode == 0, err
        assert os.listdir(shm_dir) == [name], out  # the live owner's ring stays
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(WAIT_S)
        SharedMemoryBackend(directory=shm_dir).close()  # the next job's start-up sweep
        assert os.listdir(shm_dir) == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(WAIT_S)
        if name:
            unlink_ring(name)


_FAR_CONSUMER = """
    import sys
    from knitkit.storage.delivery.consumer import MicroBatchConsumer
    from knitkit.storage.delivery.slot_ring import RingSpec
    spec = RingSpec({name!r}, 2, 4096, 1)
    consumer = MicroBatchConsumer(spec, 0, liveness_timeout_s=1.0)
    try:
        consumer.next_micro_batch(timeout_s=1.5)  # six liveness checks of a live producer
    except TimeoutError:
        print("waited", flush=True)
    except Exception as error:
        print(f"{{type(error).__name__}}: {{error}}", flush=True)
        sys.exit(1)
    sys.stdin.readline()
    with consumer.next_micro_batch(timeout_s=60) as lease:
        print("got", int(lease.fields["x"][0]), flush=True)
    consumer.close()
"""


def test_a_consumer_in_another_pid_namespace_sees_its_producer_alive() -> None:
    """A rank in a container sharing /dev/shm (``--ipc=host``) but not pids: its waits outlast
    several liveness checks without a false ``ReorganizerDiedError`` (the producer's pid is not
    visible there), and it reads what the producer publishes next."""
    prefix = unshare_pid()
    spec = RingSpec.new(num_slots=2, slot_bytes=4096, num_consumers=1)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    far = python(_FAR_CONSUMER.format(name=spec.name), *prefix)
    try:
        assert far.stdout is not None and far.stdin is not None
        assert far.stdout.readline().strip() == "waited", far.communicate(timeout=WAIT_S)
        layout = MicroBatchLayout.build({"x": ("int64", (4,))})
        layout.numpy_views(publisher.acquire(layout.nbytes))["x"][:] = 7
        publisher.publish(layout)
        far.stdin.write("go\n")
        far.stdin.flush()
        out, err = far.communicate(timeout=WAIT_S)
        assert far.returncode == 0 and out.strip() == "got 7", (out, err)
    finally:
        if far.poll() is None:
            far.kill()
            far.wait(WAIT_S)
        publisher.close()
        owner.close()
        owner.unlink()


def _named_semaphores() -> set[str]:
    """The POSIX named semaphores this process maps (multiprocessing's ``sem.mp-*``)."""
    with open("/proc/self/maps") as maps:
        return {line.split(maxsplit=5)[5].strip() for line in maps if "/dev/shm/sem." in line}


def test_a_reorganizer_process_leaves_no_named_semaphores() -> None:
    """Assignments reach a reorganizer without named semaphores: a SIGKILLed launcher used to
    leave three ``/dev/shm/sem.mp-*`` per reorganizer that nothing removes."""
    before = _named_semaphores()
    backend = SharedMemoryBackend(slab_bytes=1 << 16)
    spec = RingSpec.new(num_slots=1, slot_bytes=4096, num_consumers=1)
    with ReorganizerProcess(backend, spec) as reorganizer:
        assert reorganizer.finish(WAIT_S)
        assert _named_semaphores() == before
    backend.close()


def test_a_lock_free_ring_is_kept_while_its_pid_lives_here(shm_dir: str) -> None:
    """A ring of a knitkit before role locks holds no lock while its owner runs: the sweep keeps
    a lock-free ring whose pid is alive in this namespace and removes one whose pid is dead."""
    exited = python("pass")
    exited.wait(WAIT_S)
    live, dead = f"knitkit_{os.getpid()}_0a1b2c3d", f"knitkit_{exited.pid}_0a1b2c3d"
    for name in (live, dead):
        with open(os.path.join(shm_dir, name), "wb") as ring_file:
            ring_file.write(bytes(4096))
    sweep_dead_segments(shm_dir)
    assert sorted(os.listdir(shm_dir)) == [live]
