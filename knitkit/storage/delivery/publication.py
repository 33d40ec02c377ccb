"""Producer side of micro-batch publication: fill ring slots in order, with bounded look-ahead."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from knitkit.storage.backends.slab import populate_writable
from knitkit.storage.delivery.liveness import WaitSlices
from knitkit.storage.delivery.slot_ring import (
    DONE,
    FAILED,
    HEARTBEAT_S,
    RUNNING,
    ConsumerDiedError,
    RingClosedError,
    SlotRing,
)
from knitkit.types import MicroBatchLayout

MAX_HEARTBEAT_S = 2.0
"""The longest heartbeat period ``heartbeat_period`` picks (NOTE [ Heartbeat period ])."""

# NOTE [ Heartbeat period ]
#
# A waiting producer wakes once per heartbeat period: an idle one to beat (NOTE [ Reorganizer
# process shutdown ]), one blocked on a full ring to beat and to check its owner, its consumers
# and the segment's size (``acquire``). Each wake costs ~0.1-0.2 ms of CPU on a loaded host (the
# process and its caches are cold after the sleep): measured with transfer.py's workload (an
# idle reorganizer: 4 ms of CPU per 6 s at 4 wakes a second; 7.2 ms per 3 s look-ahead step
# against 4.4 ms back to back, the difference ~15 wakes), the larger part of a look-ahead step's
# reorganizer CPU. The period only has to be short against the consumers' liveness timeout:
# a consumer declares the producer dead once its heartbeat is older than ``liveness_timeout_s``,
# so a period of ``liveness_timeout_s / 8`` leaves 7/8 of the timeout to scheduling delays
# (a loaded host, a process stopped and resumed). It is at least HEARTBEAT_S (the period a
# producer that is not told its consumers' timeout keeps: it serves consumers down to a ~1 s
# timeout) and at most MAX_HEARTBEAT_S: the same wake is when a producer blocked on a full ring
# sees a consumer that died holding a slot (its TP peers then raise ReorganizerError) or its
# owner gone, so those stay prompt (within 2 s) under the default 30 s timeout, and a dead
# owner or a stop request is seen at once anyway where the wait can watch for it (an idle
# ReorganizerProcess's assignment pipe ends with its launcher and carries its stop; the owner's
# stop wakes a full ring's wait). Stuck or stopped producers are still declared dead within the
# consumers' ``liveness_timeout_s``, as before: only the wakes in between are fewer (8x at 30 s).
# transfer.py tells both ends 30 s: its reorganizers' CPU went 0.0286 -> 0.0206 s per step
# (look-ahead 0.0378 -> 0.0228; `--quick --skip-tq --skip-engines` back to back against
# 30f28cf, load 11-13; benchmarks/README.md, transfer). An idle wait that sees its owner's death
# and stop at once needs no cap (``idle_period``: liveness_timeout_s / 8, 3.75 s at 30 s):
# ReorganizerProcess's child waits on its assignment pipe, which ends with its launcher and
# carries its stop, so its timed wakes only beat (and back up the STOP word and the owner's
# role lock where a fork of the launcher holds the pipe open). An encoder reorganizer of
# transfer.py idles most of a step (one micro-batch per step, ~0.1-0.2 ms of CPU per idle wake
# under load): it wakes about half as often.


def heartbeat_period(liveness_timeout_s: float | None) -> float:
    """A producer's heartbeat period for consumers that declare it dead after
    ``liveness_timeout_s`` of silence (``None``: not known, HEARTBEAT_S); see NOTE [ Heartbeat
    period ]."""
    return min(MAX_HEARTBEAT_S, idle_period(liveness_timeout_s))


def idle_period(liveness_timeout_s: float | None) -> float:
    """How often an idle producer whose wait sees its owner's death and stop at once beats, for
    consumers that declare it dead after ``liveness_timeout_s`` (``heartbeat_period`` without
    its cap; NOTE [ Heartbeat period ])."""
    if liveness_timeout_s is None:
        return HEARTBEAT_S
    if liveness_timeout_s <= 0:
        raise ValueError(f"liveness_timeout_s={liveness_timeout_s}; pass a positive bound")
    return max(HEARTBEAT_S, liveness_timeout_s / 8)


# NOTE [ Micro-batch publication protocol ]
#
# Lifecycle table: docs/lifecycle.md.
#
# One ring per reorganizer: ONE /dev/shm segment holding a control block, per-slot metadata and
# `num_slots` data slots of `slot_bytes`. Its pages are allocated once (posix_fallocate) by the
# ring's owner and reused for every micro-batch of every mini-batch: fresh pages cost 5-10x the
# copy on a 2-core host like the CI machine (measured when the ring was designed).
#
# Roles. The OWNER creates and unlinks the segment (the process wrapper in the launcher, or the Ray
# actor itself). The PRODUCER (one reorganizer loop) writes micro-batches. CONSUMERS (the group's TP
# ranks, indexes 0..num_consumers-1) read them. Producer and consumers only map the segment by
# file, never through `multiprocessing.shared_memory`, so Python 3.11's resource tracker cannot
# unlink it when they exit; the owner's own tracker registration is the backstop if the owner is
# SIGKILLed.
#
# Single writer per word. Producer: STATE, PRODUCER_PID, HEARTBEAT, PUBLISHED, NOTIFY,
# BYTES_READ, ERROR_*, slot data and slot metadata. Owner: OWNER_PID, STOP (and PRODUCER_PID once,
# before the producer starts, with the same value: the spawned child's pid). Consumer c:
# RELEASED[c] and CONSUMER_PID[c] (one attachment per index: a second one, in another live
# process or in the same process, is refused).
#
# Publication of micro-batch `seq` (0, 1, 2, ... across mini-batches) into slot `seq % num_slots`:
#   1. producer waits until min_c RELEASED[c] > seq - num_slots (every consumer released the
#      slot's previous occupant), or STOP is set / the owner died / a holding consumer died (then
#      it gives up);
#   2. writes the payload into the slot, then the slot metadata (seq, layout: data only, see
#      layout_codec.py);
#   3. stores PUBLISHED = seq + 1, then NOTIFY + 1 (and wakes NOTIFY's waiters).
# Consumer c wanting `seq` reads NOTIFY, then waits until PUBLISHED > seq (blocking on NOTIFY
# between checks: NOTE [ Futex waits ] in atomic_words.py), checks the slot's seq, and hands out
# a lease (knitkit.types.PackedMicroBatch) of read-only zero-copy views, plus a copy-on-write
# view of the same bytes for the CPU iterator (NOTE [ Zero-copy hand-off ] in
# knitkit/microbatch_iter/worker.py). Each lease is released exactly once, by its holder (or,
# as a backstop, once nothing views its bytes); on release the consumer drops its private copies
# of the slot's pages it wrote (none when it only read), then stores RELEASED[c] = s + 1 for the highest s such that it has
# released s and every micro-batch before it (releases may come in any order, from any thread)
# and wakes the producer. The consumer starts no thread: whoever calls it (the training loop, or
# the MicroBatchIterator's prefetch thread during compute) waits, decodes and maps.
# PUBLISHED, RELEASED[c], STATE and ERROR_LEN are written with release stores and read with
# acquire loads, which makes steps 2 -> 3 (and a consumer's reads -> its RELEASED store) hold on
# weak memory models too: see NOTE [ Publication ordering ] in atomic_words.py. The slot seq
# check catches a stale slot.
#
# Termination. The producer sets STATE=DONE after its last micro-batch, or STATE=FAILED with the
# error text, each followed by NOTIFY + 1 and a wake. A consumer that finds no new micro-batch
# raises if STATE is FAILED, stops if DONE, and declares the producer dead if its role lock is free
# (NOTE [ Ring role locks ] in slot_ring.py) or HEARTBEAT (CLOCK_MONOTONIC, node-wide) is older
# than the liveness timeout. The owner sets STOP (and wakes the RELEASED words) to make a
# producer blocked on a full ring give up; a producer also gives up once the owner's role lock is
# free (the owner is gone).
# A consumer closed (or interrupted) from another thread of its process wakes NOTIFY and makes
# its own wait raise at once (ConsumerClosedError / InterruptedError).
#
# Waiting. The producer waits for the lagging consumer's RELEASED word, a consumer for NOTIFY,
# both in the kernel (NOTE [ Futex waits ]) in slices of one liveness period (NOTE [ Liveness
# checks off the poll path ] in liveness.py). Every wait also checks the segment's size: a file
# truncated under its mappings (another process of this user) would kill the process with SIGBUS
# at the next access, so it raises RingTruncatedError naming the ring instead (checked at attach,
# per hand-out, per acquired slot and once per period while waiting; a truncation in the
# microseconds between a check and an access still faults).
#
# Liveness is progress, not thread life. HEARTBEAT is written once per heartbeat period (NOTE
# [ Heartbeat period ]) only while the producer is IDLE (waiting for its next assignment), by a
# producer thread, or by a host whose own loop already wakes that often (ReorganizerProcess: its
# wait for the next assignment, NOTE [ Reorganizer process shutdown ]); while it is BUSY
# (`with publisher.busy():` around an assignment) only the producer's own loop writes it: at every
# wait slice on a full ring, every slot acquired after a wait and every publication. A read that
# blocks therefore stops the heartbeat and consumers raise ReorganizerDiedError after the
# liveness timeout, while a producer waiting for work or for its consumers stays alive.
#
# Dead consumers. Consumer c takes its role lock (NOTE [ Ring role locks ] in slot_ring.py), then
# writes its pid into CONSUMER_PID[c] when it attaches. It detaches by writing 0 there if the
# stream ended (STATE is DONE or FAILED), or LEFT * pid if the producer still runs (closed,
# garbage-collected, or its process exiting through Python: Ctrl-C, an exception out of a `with`,
# sys.exit), then closing its file, which drops the lock. A producer waiting for a slot checks the
# consumers that still hold it: one marked LEFT, or one whose word is a pid while its lock is free
# (it died without running Python: SIGKILL), raises ConsumerDiedError naming that consumer and the
# micro-batch it stopped at; its process wrapper (or Ray actor) then writes FAILED with that
# message, so the other TP ranks raise ReorganizerError within one liveness period instead of
# waiting on a ring that will never move again. A word of 0 means not attached yet: the producer
# waits (ranks attach when they start).


# NOTE [ Slot path in few calls ]
#
# A reorganizer acquires, fills and publishes each slot right after a wait for it, when the
# process's caches are cold and every Python call costs several times its hot cost (NOTE [ Copy
# lists ] in reorganizer.py). So the usual case, a slot already released by every consumer, is
# a few frames: one size check, every RELEASED word read in one call (``loads_acquire``) and the
# slot's view; the wait's schedule (``WaitSlices``), the lagging consumer and the beat are built
# only when the slot is still held (``_wait_for_slot``): a slot acquired without a wait follows
# the previous publication's beat (or the assignment's start) by one micro-batch's copies. A
# publication decides on a wake with one store and one read of every CONSUMER_WAITS word, and a
# unit views' range skips the fork check a reader cannot need; a wait for a held slot reads
# every RELEASED word in one call per look. At TP2 (transfer.py): 23 Python calls per
# micro-batch from the slot on, 37 at d1b4542 (tests/storage/test_reorg_copy_lists.py). Time,
# one backbone reorganizer of transfer.py's workload whose TP2 consumers hold each micro-batch
# 20 ms (so nearly every slot is waited for), 3 pairs against d1b4542 at load 20-33: views
# 46-49 -> 41-48 us and publication 55-62 -> 50-60 us per micro-batch, acquire beside its futex
# wait unchanged (65-68 -> 68-78): small against the load's swing.


class Publisher:
    """Publishes packed micro-batches into a slot ring, one sequence number after another."""

    def __init__(self, ring: SlotRing):
        self.ring = ring
        self._next = ring.published
        self._acquired: int | None = None
        self._stop_beat = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self._busy = 0
        self.heartbeat_s = HEARTBEAT_S
        """How often a waiting producer beats (NOTE [ Heartbeat period ])."""

    def start(self, *, beat_thread: bool = True, heartbeat_s: float = HEARTBEAT_S) -> None:
        """Mark the producer running and start its idle heartbeat, one beat per ``heartbeat_s``
        (see NOTE [ Micro-batch publication protocol ], NOTE [ Heartbeat period ]);
        ``beat_thread=False``: the caller's own wait loop calls ``beat_idle`` at least every
        ``heartbeat_s`` while no assignment runs."""
        self.heartbeat_s = heartbeat_s
        self.ring.claim_producer()  # NOTE [ Ring role locks ] in slot_ring.py
        spec = self.ring.spec
        populate_writable(self.ring.slot(0, spec.num_slots * spec.slot_bytes))  # once per attach
        self.ring.set_producer_pid(os.getpid())
        self.ring.beat()
        self.ring.set_state(RUNNING)
        if beat_thread:
            self._beat_thread = threading.Thread(
                target=self._beat, name="knitkit-publisher-heartbeat", daemon=True
            )
            self._beat_thread.start()

    def beat_idle(self) -> None:
        """The idle heartbeat, from a host's own wait loop (``start(beat_thread=False)``)."""
        if not self._busy:
            self.ring.beat()

    def acquire(self, nbytes: int) -> memoryview:
        """Wait until the next slot is released by every consumer; return its first ``nbytes``
        (NOTE [ Slot path in few calls ])."""
        ring = self.ring
        spec = ring.spec
        if nbytes > spec.slot_bytes:
            raise ValueError(
                f"micro-batch {self._next} needs {nbytes} bytes but ring {spec.name!r} has "
                f"slot_bytes={spec.slot_bytes}; size the slots for the largest micro-batch"
            )
        ring.check_size()
        if ring.min_released() <= self._next - spec.num_slots:
            self._wait_for_slot()
        self._acquired = self._next
        return ring.slot(self._next, nbytes)

    def _wait_for_slot(self) -> None:
        """Block until every consumer released the next slot's previous occupant, beating and
        checking the owner, the consumers and the segment's size once per heartbeat period."""
        ring, spec = self.ring, self.ring.spec
        slices = WaitSlices(check_every_s=self.heartbeat_s)  # NOTE [ Heartbeat period ]
        while True:
            lagging, released = ring.lagging()
            if released > self._next - spec.num_slots:
                break
            ring.beat()
            if ring.stop_requested:
                raise RingClosedError(f"ring {spec.name!r}: its owner asked the producer to stop")
            if slices.check_due():  # see NOTE [ Liveness checks off the poll path ] in liveness.py
                if not ring.owner_alive:  # NOTE [ Ring role locks ] in slot_ring.py
                    raise RingClosedError(
                        f"ring {spec.name!r}: its owner (pid {ring.owner_pid}) is gone"
                    )
                self._check_consumers()
                ring.check_size()
            # blocks until the lagging consumer releases (NOTE [ Futex waits ] in atomic_words.py)
            ring.wait_released(lagging, released, slices.slice_s())
        ring.beat()

    def publish(self, layout: MicroBatchLayout, record: bytes | None = None) -> int:
        """Publish the acquired slot with ``layout`` (``record``: its ``layout_codec`` record if
        the caller encoded it already); returns its sequence number."""
        seq = self._acquired
        if seq is None:
            raise RuntimeError("publish() without acquire(): acquire a slot and fill it first")
        ring = self.ring
        ring.write_meta(seq, layout, record)
        ring.set_published(seq + 1)
        ring.beat()
        self._acquired = None
        self._next = seq + 1
        return seq

    def finish(self) -> None:
        """Tell consumers there is nothing more to come."""
        self.ring.set_state(DONE)
        self._stop_heartbeat()

    def fail(self, message: str) -> None:
        """Tell consumers the producer failed; they raise with ``message``."""
        self.ring.set_error(message)
        self.ring.set_state(FAILED)
        self._stop_heartbeat()

    def close(self) -> None:
        self._stop_heartbeat()
        self.ring.close()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Mark an assignment in progress: only progress beats the heartbeat (see NOTE [ Micro-batch
        publication protocol ])."""
        self.ring.beat()
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            self.ring.beat()

    def _check_consumers(self) -> None:
        """Raise ``ConsumerDiedError`` if a consumer holding the slot we wait for died or left
        (see NOTE [ Micro-batch publication protocol ], "Dead consumers")."""
        ring = self.ring
        for consumer in range(ring.spec.num_consumers):
            held = ring.released(consumer)
            if held > self._next - ring.spec.num_slots:
                continue
            pid = ring.consumer_pid(consumer)
            where = f"consumer {consumer} (pid {abs(pid)}) of ring {ring.spec.name!r}"
            if pid < 0:
                raise ConsumerDiedError(
                    f"{where} left at micro-batch {held} while the ring still runs (closed, or "
                    "its process exited through Python: Ctrl-C, an exception, sys.exit); its TP "
                    "peers cannot go on without it: restart its TP group (every TP rank of the "
                    "ring)"
                )
            if pid and not ring.consumer_attached(consumer):
                raise ConsumerDiedError(
                    f"{where} died holding micro-batch {held}; restart its TP group (every TP "
                    "rank of the ring)"
                )

    def _beat(self) -> None:
        while not self._stop_beat.wait(self.heartbeat_s):
            if not self._busy:
                self.ring.beat()

    def _stop_heartbeat(self) -> None:
        self._stop_beat.set()
        if self._beat_thread is not None:
            self._beat_thread.join()
            self._beat_thread = None
