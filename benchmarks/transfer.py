"""Transfer benchmark: knitkit vs sample-level vs TransferQueue delivering packed micro-batches to real rank processes.

Methods: knitkit, sample-level (every rank reads its share), sample-level with TP broadcast (TP0
reads and packs, its TP peers receive), TransferQueue. A DP2 x CP2 x TP2 backbone (8 rank
processes) and a DP2 vision encoder train mini-batches of GRPO groups of 8 trajectories (MoE
routing ``[seq, layers, top-8]``, log-probs, masks, a reward, one image per group). Every method runs three regimes on the same steps, each step ending in a barrier
of all ranks (the optimizer step's synchronisation):

- eager: no compute, no look-ahead across the step's start; the figure is how long the slowest
  rank waits for its step's data (knitkit's planning included: the driver plans at the step's
  start);
- lookahead / lookahead2: every rank runs the same fixed matmul work per step on its own thread
  (NOTE [ Compute that competes ]) and every method may prepare exactly 1 / 2 micro-batches of
  the same token budget ahead (NOTE [ Equal look-ahead ]); the step's wall time is compared with
  an oracle whose micro-batches are already in each rank's memory.

CPU seconds of every process a method runs (driver, ranks with their loader workers, knitkit's
reorganizers, Ray and TransferQueue's services) are read from per-process CPU clocks (NOTE
[ Process CPU clocks ]), the ranks' compute excluded. benchmarks/README.md states the contract:
what each method does, what is counted, every key.

    python benchmarks/transfer.py [--quick] [--json PATH] [--skip-tq] [--skip-engines]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import mmap
import multiprocessing as mp
import os
import pickle
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import psutil
import torch
from lifetime import die_with_parent, end_on_sigterm
from progress import Progress
from report import finish

from knitkit.integration.sliced_read import time_ratio
from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.storage import (
    EncoderRankPlan,
    EncoderTopology,
    MicroBatchConsumer,
    MiniBatchPlan,
    PlannerConfig,
    ReorganizerProcess,
    RingSpec,
    SharedMemoryBackend,
    Topology,
    Trajectory,
    TrajectoryStore,
    UnitBackend,
    plan_minibatch,
)
from knitkit.storage.backends import pid_alive
from knitkit.storage.baselines import (
    Arena,
    LocalTrajectories,
    RankPosition,
    pack_local,
    planner_figures,
    read_share,
    receive_multimodal,
    share_reads,
    synthetic_trajectories,
)
from knitkit.storage.delivery import ReorganizerHost
from knitkit.storage.planning import RowSpec, pack_layout, padded_lengths
from knitkit.types import UnitKey

progress = Progress("transfer")

FIELDS = ("tokens", "logprobs", "loss_mask", "routing", "topp_mask")
SCALARS = ("reward",)
TOPOLOGY = Topology(dp=2, cp=2, tp=2)
ENCODER = EncoderTopology("vision", dp=2)
RANKS = tuple(RankPosition(d, c, t) for d in range(2) for c in range(2) for t in range(2))
METHODS = ("knitkit", "sample_level", "sample_level_bcast", "transferqueue")
ORACLE = "oracle"
REGIMES = ("eager", "lookahead", "lookahead2")
DEPTH = {"eager": 1, "lookahead": 1, "lookahead2": 2}
"""Micro-batches each method may prepare ahead of the one a rank computes on (NOTE [ Equal
look-ahead ]); eager has no compute, and no method starts a step's work before the step."""
WARMUP_STEPS = 1
"""Steps each phase runs before the measured ones (NOTE [ Warm-up step ])."""
TQ_PARTITION = "transfer-bench"
TQ_IMAGE = "image"
BARRIER_TIMEOUT_S = 900.0
LIVENESS_S = 30.0
"""Every knitkit ring consumer's liveness timeout (MicroBatchConsumer's default), which its
producer is told so it paces its waits to it (NOTE [ Heartbeat period ] in
knitkit/storage/delivery/publication.py), as a job's driver does with its own timeout."""

# NOTE [ Equal look-ahead ]
#
# In the look-ahead regimes every method may have exactly DEPTH[regime] micro-batches of the same
# token budget (the planner's ``max_tokens_per_micro_batch`` of one CP rank's padded tokens)
# prepared beyond the one a rank computes on, and no more, across step boundaries too:
# - knitkit: one MicroBatchIterator(depth=D) per rank for the whole phase, over its consumer's
#   take() of every micro-batch of the phase, on a ring of D + 1 slots (the held micro-batch and
#   D ahead; the CPU hand-off is zero-copy, so staged micro-batches hold their ring slots and the
#   reorganizer cannot run further ahead). The driver submits step s + 1 at the start of step s.
# - sample_level: one thread per rank reads the step's share, shares the images and packs micro-
#   batch by micro-batch into D + 1 reused buffers, taking a buffer's credit before each; the loop
#   hands its buffer's credit back when it asks for the next micro-batch (so D are ahead of it);
#   sample_level_bcast the same on TP0, and its TP peers' thread receives with the same credits.
# - transferqueue: its StreamingDataLoader with one worker and prefetch_factor=D (the loader keeps
#   D requests in flight beyond the micro-batch the loop holds); the worker fetches the DP rank's
#   rows and, in TQ's process_batch_fn and collate_fn, splits them into micro-batches of the same
#   token budget and packs this rank's CP share, so packing happens in the worker, not the loop.
# Eager: knitkit's iterator at depth 1 over a 2-slot ring, sample-level inline, TQ without
# workers; the driver submits knitkit's step at the step's start, after planning it.

# NOTE [ Compute that competes ]
#
# A step's compute is a fixed number of fp32 matmuls (Sizes.matmuls_per_step of size x size) on
# the rank's own thread (one torch thread), split over the rank's micro-batches of the step, plus
# one read of every byte of each micro-batch (standing for its host-to-device copy). It is fixed
# work, not a sleep or a wall-clock deadline: helper threads and helper processes take cores from
# it, so their cost shows in the step's wall time. The same work runs in the oracle, whose
# micro-batches are already packed in the rank's private memory: a method's step-wall overhead is
# its step time over the oracle's, minus 1. The thread CPU time of the compute is measured and
# taken out of the CPU figures, so those count only the data path.

# NOTE [ Warm-up step ]
#
# Every phase runs one step before its measured ones, with data of its own: helpers started for
# the phase get to the steady state a training job spends its steps in (knitkit's reorganizer
# processes finish importing, a sample-level thread and a TQ loader worker start, every look-ahead
# fills). That step is in no figure: CPU clocks are read when every rank has finished it, and its
# waits and wall time are dropped. Start-up is a once-per-job cost for every method (Ray and TQ's
# start is not counted either). What a job pays every step stays in: each step's trajectories are
# new to every reader, so every phase reads the store through handles that have none of its pages
# mapped (knitkit: fresh reorganizer processes per phase; sample-level: each rank reopens its store
# handle). A shared-memory handle maps the pages of each slab up to the slab's high-water mark at
# its first read (NOTE [ Populated mappings ] in knitkit/storage/backends/slab.py), in the
# warm-up step for both methods: as a job's long-lived readers have them mapped, since its new
# trajectories reuse the extents of released ones. Every later step's units are still new
# to the handle: it has read none of their bytes before.
# Buffers a careful user allocates once (sample-level's arenas) are sized before the run.

# NOTE [ Process CPU clocks ]
#
# CPU seconds come from each process's CPU-time clock (clock_gettime on the clock id
# glibc's clock_getcpuclockid(pid) returns: ((~pid) << 3) | 2; all threads, nanoseconds, readable
# for any process of the same user), plus the CPU of its children that exited and were reaped
# (/proc cutime + cstime, through psutil: a TransferQueue loader worker), plus its live
# descendants. /proc's per-process ticks (10 ms) are too coarse for steps of a few ms of CPU.
# The driver counts its own process only (its reaped children are ranks and reorganizers,
# counted on their own). Readings are taken while every rank waits at a barrier.

# NOTE [ Delivery's floor ]
#
# knitkit delivers each byte with one copy, a reorganizer's fill of its ring slot (NOTE [ Fill
# time ] in knitkit/storage/delivery/reorganizer.py), and every method's CPU figure includes the
# step barriers and loop that `oracle.cpu_s_per_step` measures alone. So `knitkit.cpu_s_per_step`
# can be no lower than the fills' thread CPU plus the oracle's figure, both measured in this run
# over the same steps and the same windows, and `knitkit.delivered_fraction_of_memcpy.ceiling`
# (the delivered bytes over that sum, against `memcpy_gbps`) is the most the headline fraction
# could reach if knitkit spent nothing else. The fills run as they do in the run: in the
# look-ahead regimes beside 8 ranks' compute on the same cores, where a copy runs slower than
# `memcpy_gbps`'s quiet one (`.fills`: the fills' own bytes per CPU second against it). A fill
# that straddles a window's edge counts on the side it ends (at most one micro-batch per
# reorganizer at each edge).

# NOTE [ TQ clients closed ]
#
# A rank closes the TransferQueue client its eager phase made in its own process (a loader
# without workers) when the phase ends; a look-ahead phase's client lives in the loader's worker,
# which exits with it. Left open, the client's ZMQ I/O threads outlived the TQ services (stopped
# before the next phase) and kept reconnecting to them through the last oracle phase: ~25 ms of
# CPU per rank and step (~80 wakes) against ~0.5 ms for the loop and barriers
# (per-thread schedstat, `--methods transferqueue`, load 22-25), which `oracle.cpu_s_per_step`
# counted (0.012-0.018 in full-schedule runs against 0.004 with `--skip-tq`). TQ is the last
# method, so no method's figure held it.


@dataclass(frozen=True, slots=True)
class Sizes:
    """Workload of one run; ``--quick`` changes only the number of steps."""

    samples_per_step: int = 2
    group_size: int = 8
    min_tokens: int = 4096
    max_tokens: int = 16384
    routing_layers: int = 48
    image_patches: int = 1024
    patch_dim: int = 1176
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch on one CP rank (padded tokens), for every method."""
    matmul: int = 256
    matmuls_per_step: int = 1400
    """Compute per rank and step (NOTE [ Compute that competes ]): 47 GFLOP at 256."""
    steps: int = 8
    """Measured steps per phase (after WARMUP_STEPS)."""
    sliced_units: int = 16
    sliced_rows: int = 16384
    repeats: int = 7


FULL = Sizes()
QUICK = replace(FULL, steps=3)


@dataclass(frozen=True, slots=True)
class Phase:
    """One method in one regime over every step (the oracle repeats between methods)."""

    method: str
    regime: str
    index: int = 0

    @property
    def name(self) -> str:
        return (
            f"{self.method}{self.index}"
            if self.method == ORACLE
            else f"{self.regime}.{self.method}"
        )

    @property
    def depth(self) -> int:
        return DEPTH[self.regime]

    @property
    def computes(self) -> bool:
        return self.regime != "eager"


def schedule(with_tq: bool, methods: tuple[str, ...] = METHODS) -> list[Phase]:
    """Every method's three regimes (of ``methods``: ``--methods``), with an oracle phase before
    the first method and after each one, so the oracle's steps sample the machine's state
    around every method's."""
    phases = [Phase(ORACLE, "lookahead", 0)]
    for method in (m for m in methods if with_tq or m != "transferqueue"):
        phases += [Phase(method, regime) for regime in REGIMES]
        phases.append(Phase(ORACLE, "lookahead", len(phases)))
    return phases


def trajectories(sizes: Sizes, steps: int) -> list[Trajectory]:
    """The first ``steps`` steps' trajectories (the same prefix whatever ``steps`` is)."""
    return synthetic_trajectories(
        sizes.samples_per_step * steps,
        group_size=sizes.group_size,
        min_tokens=sizes.min_tokens,
        max_tokens=sizes.max_tokens,
        routing_layers=sizes.routing_layers,
        routing_topk=8,
        image_patches=sizes.image_patches,
        patch_dim=sizes.patch_dim,
    )


@dataclass(slots=True)
class Workload:
    """The stored trajectories, each step's metadata and plan, and what a step consumes."""

    store: TrajectoryStore
    plans: list[MiniBatchPlan]
    metas: list[list[Any]]
    """Each step's trajectory metadata, as the planner gets it."""
    consumed: dict[str, int]
    """Bytes the steps consume, per field kind ("fields": per-token and scalar; "image")."""
    config: PlannerConfig

    def plan(self, step: int, minibatch_id: str) -> MiniBatchPlan:
        return plan_minibatch(self.metas[step], TOPOLOGY, self.config, (ENCODER,), minibatch_id)


def build_workload(sizes: Sizes) -> Workload:
    """Store trajectories in shared memory; plan each step; bytes the steps consume."""
    stored = trajectories(sizes, WARMUP_STEPS + sizes.steps)
    store = TrajectoryStore(SharedMemoryBackend(slab_bytes=256 << 20))
    for trajectory in stored:
        store.write(trajectory)
    per_step = sizes.samples_per_step * sizes.group_size
    config = PlannerConfig(
        token_fields=FIELDS, max_tokens_per_micro_batch=sizes.micro_batch_tokens, keep_groups=True
    )
    work = Workload(store, [], [], {"fields": 0, "image": 0}, config)
    for step in range(WARMUP_STEPS + sizes.steps):
        ids = [t.trajectory_id for t in stored[step * per_step : (step + 1) * per_step]]
        metas = store.metas(ids)
        work.metas.append(metas)
        work.plans.append(work.plan(step, f"mb{step}"))
        fields = {UnitKey(m.trajectory_id, f) for m in metas for f in (*FIELDS, *SCALARS)}
        images = {ref.key for m in metas for ref in m.multimodal}
        work.consumed["fields"] += sum(store.backend.spec(k).nbytes for k in fields)
        work.consumed["image"] += sum(store.backend.spec(k).nbytes for k in images)
    return work


def schema_of(store: TrajectoryStore, plans: list[MiniBatchPlan]) -> dict[str, RowSpec]:
    """Every field's dtype and row shape (every stored trajectory has the same fields)."""
    return store.schema(plans[0].consumers[0].micro_batches[0].sequences[0].trajectory_id)


def slot_bytes(store: TrajectoryStore, plans: list[MiniBatchPlan]) -> tuple[int, int, int]:
    """Largest backbone micro-batch, encoder micro-batch and DP share of images (sample-level
    redistribution), so one slot of each ring fits any of them."""
    schema = schema_of(store, plans)
    backbone = max(
        pack_layout(mb, schema).nbytes for p in plans for c in p.consumers for mb in c.micro_batches
    )
    encoder = max(
        sum(store.backend.spec(k).nbytes + 64 for k in mb)
        for p in plans
        for r in p.encoder("vision").ranks
        for mb in r.micro_batches
    )
    images = max(
        sum(store.backend.spec(k).nbytes + 64 for k in share_images_of(p, dp))
        for p in plans
        for dp in range(TOPOLOGY.dp)
    )
    return backbone, encoder, images


def share_images_of(plan: MiniBatchPlan, dp: int) -> set[UnitKey]:
    """The multimodal units of DP rank ``dp``'s share."""
    return {
        r.key
        for mb in plan.consumer(dp, 0).micro_batches
        for s in mb.sequences
        for r in s.multimodal
    }


@dataclass(frozen=True, slots=True)
class RingSet:
    """knitkit's rings for one look-ahead depth: one per (DP, CP) group, one per encoder rank."""

    backbone: dict[tuple[int, int], RingSpec]
    encoder: list[RingSpec]

    @classmethod
    def new(cls, depth: int, backbone_bytes: int, encoder_bytes: int) -> RingSet:
        slots = depth + 1  # the micro-batch a rank holds and ``depth`` ahead
        return cls(
            {
                (d, c): RingSpec.new(
                    num_slots=slots, slot_bytes=backbone_bytes, num_consumers=TOPOLOGY.tp
                )
                for d in range(TOPOLOGY.dp)
                for c in range(TOPOLOGY.cp)
            },
            [
                RingSpec.new(num_slots=slots, slot_bytes=encoder_bytes, num_consumers=1)
                for _ in range(ENCODER.dp)
            ],
        )


@dataclass(slots=True)
class RankSetup:
    """What one rank process needs (picklable)."""

    rank: RankPosition
    backend: UnitBackend
    plans: list[MiniBatchPlan]
    rings: dict[str, RingSet]
    """knitkit's rings per regime (its reorganizers create them before the phase)."""
    image_rings: dict[str, RingSpec]
    """Sample-level's image-share ring of this rank's DP group, per regime (TP0/CP0 makes it)."""
    bcast: dict[str, _Broadcast]
    """The broadcast variant's channel of this rank's (DP, CP) group, per regime."""
    bcast_image_rings: dict[str, RingSpec]
    """The broadcast variant's image-share ring of this rank's DP group (TP0/CP0 to the other
    CP ranks' TP0), per regime."""
    sizes: Sizes
    phases: list[Phase]
    tq_config: Any
    """A queue that hands the rank TransferQueue's config before its first phase; None without."""


class Compute:
    """The training step's stand-in: fixed matmul work on this thread and a read of every byte of
    each micro-batch (NOTE [ Compute that competes ]); ``thread_s`` sums its thread CPU time."""

    def __init__(self, size: int, per_step: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.a = torch.randn(size, size, generator=generator) / size**0.5
        self.x = torch.randn(size, size, generator=generator)
        self.y = torch.empty(size, size)
        self.per_step = per_step
        self.thread_s = 0.0

    def share(self, index: int, count: int) -> int:
        """Matmuls of micro-batch ``index`` of a step of ``count``: the step's work split evenly."""
        base, extra = divmod(self.per_step, count)
        return base + (index < extra)

    def run(self, packed: np.ndarray, matmuls: int) -> None:
        start = time.thread_time()
        flat = packed.reshape(-1).view(np.uint8)
        np.bitwise_or.reduce(flat[: flat.nbytes // 8 * 8].view(np.uint64))
        for _ in range(matmuls):
            torch.mm(self.a, self.x, out=self.y)
            torch.tanh_(self.y)
            self.x, self.y = self.y, self.x
        self.thread_s += time.thread_time() - start


class _Steps:
    """The rank's side of a phase's barriers, which the driver mirrors (``_run_phase``): ready
    (the driver's helpers exist; the rank sets up its side), start, one per step (the optimizer
    step's synchronisation), two around the measured steps (every rank waits while the driver
    reads CPU clocks), done (the rank's side is torn down). Step 0 warms up (helpers start, the
    look-ahead fills) and is left out of every figure (NOTE [ Warm-up step ])."""

    def __init__(self, barrier: Any, count: int, compute: Compute) -> None:
        self.barrier = barrier
        self.count = count
        self.compute = compute
        self.compute_s = 0.0
        """Thread CPU time of the compute over the measured steps."""

    def wait(self) -> None:
        self.barrier.wait(BARRIER_TIMEOUT_S)

    def run(self, on_start: Callable[[], None] | None = None) -> Iterator[int]:
        self.wait()  # start
        if on_start is not None:
            on_start()
        for step in range(self.count):
            if step == 1:
                self.wait()  # warm-up over: the driver reads CPU clocks
                self.compute_s = -self.compute.thread_s
            self.wait()
            yield step
        self.wait()  # last step over: the driver reads CPU clocks
        self.compute_s += self.compute.thread_s
        self.wait()


def rank_main(setup: RankSetup, barrier: Any, results: Any) -> None:
    """One training rank: every phase of the schedule in order; reports, per phase, the waits of
    the measured steps and the thread CPU time of its compute over them, and the bytes it read."""
    die_with_parent()
    try:
        torch.set_num_threads(1)
        rank = _Rank(setup)
        barrier.wait(BARRIER_TIMEOUT_S)  # every rank ready
        report: dict[str, tuple[list[float], float]] = {}
        for phase in setup.phases:
            steps = _Steps(barrier, len(setup.plans), rank.compute)
            steps.wait()  # ready
            waits = getattr(rank, phase.method)(phase, steps)
            steps.wait()  # done
            report[phase.name] = (waits[1:], steps.compute_s)
        results.put((setup.rank, report, rank.read))
    except BaseException:
        barrier.abort()  # every other party raises at once instead of waiting out its timeout
        raise


class _Rank:
    """One rank's side of every method; each method's phase returns the per-step waits."""

    def __init__(self, setup: RankSetup) -> None:
        self.setup = setup
        self.rank = rank = setup.rank
        self.compute = Compute(setup.sizes.matmul, setup.sizes.matmuls_per_step)
        self.groups = [plan.consumer(rank.dp, rank.cp) for plan in setup.plans]
        self.backend = setup.backend
        self.raw = Arena()
        self.packed = [Arena() for _ in range(max(DEPTH.values()) + 1)]
        for plan, group in zip(setup.plans, self.groups, strict=True):  # sized for every step
            self.raw.reset()
            for _ in pack_local(
                group, read_share(setup.backend, plan, rank, self.raw), self.packed
            ):
                pass
        for arena in (self.raw, *self.packed):
            arena.reset()
        self.read: dict[str, dict[str, int]] = {"sample_level": _share_bytes(setup)}
        self.read["sample_level_bcast"] = (
            _share_bytes(setup) if self.rank.tp == 0 else {"fields": 0, "image": 0}
        )
        self.read["transferqueue"] = {"fields": 0, "image": 0}
        self.in_memory = [  # the oracle's micro-batches, packed in this rank's private memory
            [packed for _, packed in pack_local(group, read_share(setup.backend, plan, rank))]
            for plan, group in zip(setup.plans, self.groups, strict=True)
        ]
        self.tq_config: Any = None

    def oracle(self, phase: Phase, steps: _Steps) -> list[float]:
        """Compute over micro-batches already in memory: no data path at all."""
        for step in steps.run():
            batches = self.in_memory[step]
            for index, packed in enumerate(batches):
                self.compute.run(packed, self.compute.share(index, len(batches)))
        return [0.0] * steps.count

    def knitkit(self, phase: Phase, steps: _Steps) -> list[float]:
        """The rank's consumer under one MicroBatchIterator (its one prefetch thread) for the
        phase; TP0/CP0 also takes its encoder rank's micro-batches at each step's start."""
        rank, rings = self.rank, self.setup.rings[phase.regime]
        counts = [len(group.micro_batches) for group in self.groups]
        backbone = MicroBatchConsumer(
            rings.backbone[(rank.dp, rank.cp)], rank.tp, liveness_timeout_s=LIVENESS_S
        )
        encoder = (
            MicroBatchConsumer(rings.encoder[rank.dp], 0, liveness_timeout_s=LIVENESS_S)
            if rank.reads_multimodal
            else None
        )
        config = MicroBatchIterator.Config(depth=phase.depth)
        waits = []
        try:
            with MicroBatchIterator(backbone.take(sum(counts)), config, device="cpu") as batches:
                for step in steps.run():
                    wait = 0.0
                    if encoder is not None:
                        start = time.perf_counter()
                        vision = self.setup.plans[step].encoder(ENCODER.name).ranks[rank.dp]
                        for lease in encoder.take(len(vision.micro_batches)):
                            lease.release()
                        wait += time.perf_counter() - start
                    for index in range(counts[step]):
                        start = time.perf_counter()
                        batch = next(batches)
                        wait += time.perf_counter() - start
                        if phase.computes:
                            self.compute.run(
                                batch.flat.numpy(), self.compute.share(index, counts[step])
                            )
                    waits.append(wait)
        finally:
            backbone.close()
            if encoder is not None:
                encoder.close()
        return waits

    def sample_level(self, phase: Phase, steps: _Steps) -> list[float]:
        """Whole trajectories of the DP share read by every rank, images shared by TP0/CP0,
        micro-batches packed from the local copies into reused buffers."""
        self._reopen_store()
        # TP0/CP0 makes the ring before the start barrier, its peers attach at their first step
        index = self.rank.cp * TOPOLOGY.tp + self.rank.tp - 1
        images = _ImageShare(self.rank, self.setup.image_rings[phase.regime], self.backend, index)
        return self._sample_level(phase, steps, images, None)

    def sample_level_bcast(self, phase: Phase, steps: _Steps) -> list[float]:
        """The Megatron habit (``get_batch_on_this_tp_rank``): TP rank 0 reads the DP share
        (images shared by TP0/CP0 with the other CP ranks' TP0) and packs, then broadcasts each
        packed micro-batch to its TP peers, who receive a copy (NOTE [ Broadcast on one node ])."""
        channel = self.setup.bcast[phase.regime]
        images = None
        if self.rank.tp == 0:
            self._reopen_store()
            spec = self.setup.bcast_image_rings[phase.regime]
            images = _ImageShare(self.rank, spec, self.backend, self.rank.cp - 1)
        return self._sample_level(phase, steps, images, channel)

    def _sample_level(
        self,
        phase: Phase,
        steps: _Steps,
        images: _ImageShare | None,
        channel: _Broadcast | None,
    ) -> list[float]:
        """Both sample-level variants; ``images`` is None on a rank that only receives."""
        waits = []
        if not phase.computes:
            for step in steps.run():
                start = time.perf_counter()
                for _ in _sample_level_batches(self, step, images, channel, self.packed):
                    pass
                waits.append(time.perf_counter() - start)
        else:
            started: list[_SampleLevelPrefetch] = []

            def start_thread() -> None:  # at the phase's start, like every method's helpers
                started.append(_SampleLevelPrefetch(self, images, channel, phase.depth))

            for step in steps.run(start_thread):
                wait, count = 0.0, len(self.groups[step].micro_batches)
                for index in range(count):
                    start = time.perf_counter()
                    packed = started[0].next()
                    wait += time.perf_counter() - start
                    self.compute.run(packed, self.compute.share(index, count))
                waits.append(wait)
            started[0].join()
        if images is not None:
            images.close()
        return waits

    def _reopen_store(self) -> None:
        """A fresh handle on the store, with none of its pages mapped, as knitkit's reorganizers
        (fresh processes each phase) have; its first read maps them (NOTE [ Warm-up step ])."""
        fresh = pickle.loads(pickle.dumps(self.backend))
        self.backend.close()
        self.backend = fresh

    def transferqueue(self, phase: Phase, steps: _Steps) -> list[float]:
        """TransferQueue's StreamingDataLoader over a StreamingDataset (RankAwareSampler: a DP
        rank's TP/CP peers get the same rows), split into micro-batches of the token budget and
        packed for this rank's CP share by TQ's own hooks (NOTE [ Equal look-ahead ])."""
        from transfer_queue.dataloader import StreamingDataLoader, StreamingDataset

        if self.tq_config is None:
            self.tq_config = self.setup.tq_config.get(timeout=BARRIER_TIMEOUT_S)
        plans, rank = self.setup.plans, self.rank
        rows = sum(len(mb.sequences) for c in plans[0].consumers for mb in c.micro_batches)
        rows //= TOPOLOGY.dp * TOPOLOGY.cp  # trajectories per DP rank and step
        dataset = StreamingDataset(
            config=self.tq_config,
            batch_size=rows,
            micro_batch_size=1,
            data_fields=[*FIELDS, *SCALARS, TQ_IMAGE],
            partition_id=TQ_PARTITION,
            task_name=phase.regime,
            dp_rank=rank.dp,
            process_batch_fn=TokenBudgetSplit(self.setup.sizes.micro_batch_tokens),
        )
        eager = not phase.computes
        loader = StreamingDataLoader(
            dataset,
            num_workers=0 if eager else 1,
            prefetch_factor=None if eager else phase.depth,
            collate_fn=PackCollate(rank, self.packed if eager else None),
        )
        started: list[Iterator[Any]] = []
        waits = []
        for _ in steps.run(lambda: started.append(iter(loader))):
            wait = 0.0
            while True:
                start = time.perf_counter()
                packed, index, count, moved = next(started[0])
                wait += time.perf_counter() - start
                if eager:
                    for name, nbytes in moved.items():
                        self.read["transferqueue"]["image" if name == TQ_IMAGE else "fields"] += (
                            nbytes
                        )
                else:
                    self.compute.run(packed.numpy(), self.compute.share(index, count))
                if index == count - 1:
                    break
            waits.append(wait)
        del started[:]  # shuts the loader's worker down (counted in this phase)
        client = dataset._tq_client  # eager: the loop's own (NOTE [ TQ clients closed ])
        if client is not None:
            client.close()
        return waits


class _ImageShare:
    """Sample-level redistribution of images: TP0/CP0 publishes its DP share's images, the DP
    group's other ranks copy them (into the step's arena).

    TP0/CP0 owns the ring (made before the ranks' start barrier, so the peers attach after it)
    and publishes each step's images as one micro-batch of whole units, read from the store."""

    def __init__(
        self, rank: RankPosition, spec: RingSpec, backend: UnitBackend, index: int
    ) -> None:
        self.rank, self.spec, self.index = rank, spec, index
        self.out: ReorganizerHost | None = None
        self.into: MicroBatchConsumer | None = None
        self.shared = 0
        if rank.reads_multimodal:
            self.out = ReorganizerHost(backend, spec, owns_ring=True, liveness_timeout_s=LIVENESS_S)

    def share(self, local: LocalTrajectories) -> None:
        if self.out is not None:
            keys = tuple(k for k in local.units if k.field in ("image", "video"))
            plan = EncoderRankPlan("images", self.rank.dp, (keys,))
            self.out.deliver(f"images{self.shared}", plan)
        else:
            if self.into is None:
                self.into = MicroBatchConsumer(self.spec, self.index, liveness_timeout_s=LIVENESS_S)
            receive_multimodal(self.into, local)
        self.shared += 1

    def close(self) -> None:
        if self.out is not None:
            self.out.finish()
            self.out.close()
        elif self.into is not None:
            self.into.close()


def _sample_level_batches(
    rank: _Rank,
    step: int,
    images: _ImageShare | None,
    channel: _Broadcast | None,
    buffers: list[Arena],
    credit: Callable[[], None] = lambda: None,
) -> Iterator[np.ndarray]:
    """A sample-level rank's micro-batches of ``step`` in ``buffers`` in turn: read the share,
    share the images, pack (and broadcast, on a TP0 with a ``channel``), or receive each one
    (a TP peer); ``credit()`` runs before every micro-batch after the first."""
    group = rank.groups[step]
    if channel is not None and rank.rank.tp != 0:
        for index in range(len(group.micro_batches)):
            if index:
                credit()
            yield channel.receive(buffers[index % len(buffers)], rank.rank.tp - 1)
        return
    rank.raw.reset()
    local = read_share(rank.backend, rank.setup.plans[step], rank.rank, rank.raw)
    if images is not None:
        images.share(local)
    for index, (_, buffer) in enumerate(pack_local(group, local, buffers)):
        if index:
            credit()
        if channel is not None:
            channel.send(buffer)
        yield buffer


# NOTE [ Broadcast on one node ]
#
# The broadcast sample-level variant's TP "broadcast" is the cheapest one a node has: TP0 copies
# each packed micro-batch into a shared-memory slot and every TP peer copies it out into its own
# buffer (two copies, no serialisation, no socket), with two semaphores for flow control (slots
# free, slots filled per peer). gloo's broadcast over loopback copies more; NCCL on GPUs moves
# device memory instead. So this variant is the strongest form of the habit on one machine.


_BCAST = "/dev/shm/knitkit-bench-bcast-"
"""Prefix of a broadcast channel's segment; ``<driver pid>-<hex>`` follows."""


def remove_dead_channels() -> list[str]:
    """Unlink the broadcast segments of runs whose driver is dead (a SIGKILLed run runs no
    ``unlink``); returns their paths. The driver's pid in the name says whose it is."""
    removed = []
    for path in glob.glob(f"{_BCAST}*-*"):
        pid = path[len(_BCAST) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed


class _Broadcast:
    """TP0 -> TP peers through ``slots`` shared-memory slots (NOTE [ Broadcast on one node ]);
    made by the driver (``create``, ``unlink``), handed to the rank processes pickled."""

    def __init__(self, ctx: Any, slots: int, slot_bytes: int, peers: int) -> None:
        self.path = f"{_BCAST}{os.getpid()}-{id(self):x}"
        self.slots, self.stride, self.peers = slots, slot_bytes + 64, peers
        self.free = ctx.Semaphore(slots * peers)
        self.filled = [ctx.Semaphore(0) for _ in range(peers)]
        self._view: np.ndarray | None = None
        self._sent = self._received = 0

    def __getstate__(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in ("path", "slots", "stride", "peers", "free")}
        return state | {"filled": self.filled, "_view": None, "_sent": 0, "_received": 0}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def create(self) -> None:
        with open(self.path, "wb") as segment:
            segment.truncate(self.slots * self.stride)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _slot(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        if self._view is None:
            with open(self.path, "r+b") as segment:
                self._view = np.frombuffer(mmap.mmap(segment.fileno(), 0), np.uint8)
        raw = self._view[(seq % self.slots) * self.stride :][: self.stride]
        return raw[:8].view(np.int64), raw[64:]

    def send(self, packed: np.ndarray) -> None:
        for _ in range(self.peers):  # every peer copied this slot's previous micro-batch out
            if not self.free.acquire(timeout=BARRIER_TIMEOUT_S):
                raise TimeoutError("broadcast: a TP peer did not take its micro-batch")
        size, data = self._slot(self._sent)
        flat = packed.reshape(-1).view(np.uint8)
        size[0] = flat.nbytes
        np.copyto(data[: flat.nbytes], flat)
        self._sent += 1
        for filled in self.filled:
            filled.release()

    def receive(self, into: Arena, peer: int) -> np.ndarray:
        """The next micro-batch, copied into ``into``; ``peer``: this rank's TP rank - 1."""
        if not self.filled[peer].acquire(timeout=BARRIER_TIMEOUT_S):
            raise TimeoutError("broadcast: TP0 sent nothing")
        size, data = self._slot(self._received)
        into.reset()
        out = into.take(int(size[0]))
        np.copyto(out, data[: out.nbytes])
        self._received += 1
        self.free.release()
        return out


class _SampleLevelPrefetch:
    """A careful sample-level loader with look-ahead: a thread reads each step's share, shares the
    images and packs micro-batch by micro-batch into ``depth + 1`` reused buffers (or, a TP peer
    in the broadcast variant, receives them), at most ``depth`` ahead of the one the loop holds
    (NOTE [ Equal look-ahead ])."""

    def __init__(
        self, rank: _Rank, images: _ImageShare | None, channel: _Broadcast | None, depth: int
    ) -> None:
        self._rank = rank
        self._images = images
        self._channel = channel
        self._buffers = rank.packed[: depth + 1]
        self._credits = threading.Semaphore(depth + 1)  # a buffer each: held + ``depth`` ahead
        self._ready: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._holds = False
        self._thread = threading.Thread(target=self._run, name="sample-level-prefetch")
        self._thread.start()

    def _run(self) -> None:
        rank = self._rank
        packed = 0  # micro-batches packed so far: the buffers rotate across steps
        try:
            for step in range(len(rank.groups)):
                self._credits.acquire()  # for the step's first micro-batch, read with the share
                turn = packed % len(self._buffers)
                buffers = self._buffers[turn:] + self._buffers[:turn]
                for buffer in _sample_level_batches(
                    rank, step, self._images, self._channel, buffers, self._credits.acquire
                ):
                    self._ready.put(buffer)
                    packed += 1
        except BaseException as exc:  # carried to the consumer, raised there
            self._ready.put(exc)

    def next(self) -> np.ndarray:
        if self._holds:
            self._credits.release()  # the loop is done with the micro-batch it held
        item = self._ready.get(timeout=BARRIER_TIMEOUT_S)
        if isinstance(item, BaseException):
            raise item
        self._holds = True
        return item  # type: ignore[return-value]

    def join(self) -> None:
        self._thread.join(timeout=BARRIER_TIMEOUT_S)


class TokenBudgetSplit:
    """TQ's ``process_batch_fn``: a DP rank's fetched rows split into micro-batches of at most
    ``budget`` padded tokens per CP rank (first fit, longest first, as dynamic batching does);
    yields ``(rows, meta, index, count)``."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def __call__(self, batch: Any, meta: Any, micro_batch_size: int = 1) -> list[Any]:
        from tensordict import TensorDict

        column = batch[FIELDS[0]]
        lengths = (
            column.offsets().diff().numpy() if column.is_nested else [column.shape[1]] * len(column)
        )
        per_cp = padded_lengths(np.asarray(lengths), TOPOLOGY.pad_multiple) // TOPOLOGY.cp
        bins = token_bins(per_cp.tolist(), self.budget)
        nested = {k: v.unbind(0) for k, v in batch.items() if v.is_nested}
        dense = {k: v for k, v in batch.items() if not v.is_nested}
        out = []
        for index, rows in enumerate(bins):
            chunk = TensorDict({k: v[rows] for k, v in dense.items()}, batch_size=(len(rows),))
            for name, values in nested.items():
                chunk[name] = torch.nested.as_nested_tensor(
                    [values[r] for r in rows], layout=torch.jagged
                )
            out.append((chunk, meta.select_samples(rows), index, len(bins)))
        return out


def token_bins(tokens: list[int], budget: int) -> list[list[int]]:
    """Row indices in bins of at most ``budget`` tokens, first fit in decreasing length (a row
    longer than the budget gets a bin of its own); each bin's rows ascending."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in sorted(range(len(tokens)), key=lambda r: -tokens[r]):
        for b, load in enumerate(loads):
            if load + tokens[row] <= budget:
                bins[b].append(row)
                loads[b] += tokens[row]
                break
        else:
            bins.append([row])
            loads.append(tokens[row])
    return [sorted(b) for b in bins]


class PackCollate:
    """TQ's ``collate_fn``: packs one micro-batch's rows for this rank's CP share; into reused
    buffers in the loop (no workers), into fresh memory in a worker (the loader moves it to the
    loop through shared memory, so a buffer cannot be reused)."""

    def __init__(self, rank: RankPosition, buffers: list[Arena] | None) -> None:
        self.rank = rank
        self.buffers = buffers

    def __call__(self, item: Any) -> tuple[torch.Tensor, int, int, dict[str, int]]:
        from knitkit.integration.transferqueue import pack_streamed

        rows, _, index, count = item
        buffer = self.buffers[index % len(self.buffers)] if self.buffers else Arena()
        _, packed, moved = pack_streamed(rows, self.rank, TOPOLOGY, FIELDS, SCALARS, buffer, index)
        return torch.from_numpy(packed), index, count, moved


def _share_bytes(setup: RankSetup) -> dict[str, int]:
    """Bytes one sample-level rank reads per field kind in one regime (what ``read_share`` reads)."""
    out = {"fields": 0, "image": 0}
    for plan in setup.plans:
        for key in share_reads(plan, setup.rank):
            kind = "image" if key.field in ("image", "video") else "fields"
            out[kind] += setup.backend.spec(key).nbytes
    return out


def _cpu_clock(pid: int) -> int:
    """The CPU-time clock id of process ``pid`` (NOTE [ Process CPU clocks ])."""
    return ((~pid) << 3) | 2


class CpuMeter:
    """CPU seconds of process trees, read while the ranks wait (NOTE [ Process CPU clocks ])."""

    def own(self, pid: int) -> float:
        """Process ``pid`` alone (every thread), 0 if it is gone."""
        try:
            return time.clock_gettime(_cpu_clock(pid))
        except OSError:
            return 0.0

    def tree(self, pid: int) -> float:
        """``pid``, its live descendants and the children each of them reaped."""
        try:
            procs = [psutil.Process(pid)]
            procs += procs[0].children(recursive=True)
        except psutil.Error:
            return 0.0
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += self.own(proc.pid) + times.children_user + times.children_system
        return total


@dataclass(slots=True)
class _Processes:
    """Every process of a phase by its key: the driver, each rank, knitkit's reorganizers, the
    TransferQueue services (a host process running Ray and TQ, with its descendants)."""

    ranks: dict[str, int]
    reorganizers: dict[str, int] = field(default_factory=dict)
    services: int | None = None

    def read(self, meter: CpuMeter, *, driver_last: bool) -> dict[str, float]:
        """Every process's CPU seconds; the driver's own clock last at a window's start and
        first at its end, so reading the others' (/proc scans) stays outside the window."""
        out = {} if driver_last else {"driver": meter.own(os.getpid())}
        out |= {f"rank.{name}": meter.tree(pid) for name, pid in self.ranks.items()}
        out |= {f"reorganizer.{name}": meter.own(pid) for name, pid in self.reorganizers.items()}
        if self.services is not None:
            out["services"] = meter.tree(self.services)
        if driver_last:
            out["driver"] = meter.own(os.getpid())
        return out


def rank_name(rank: RankPosition) -> str:
    return f"dp{rank.dp}cp{rank.cp}tp{rank.tp}"


class _Knitkit:
    """The driver's side of knitkit: a reorganizer process per ring of the current depth, planning
    each step and submitting it (eager: at the step's start; look-ahead: one step ahead)."""

    def __init__(self, work: Workload, rings: dict[str, RingSet]) -> None:
        self.work, self.rings = work, rings
        self.reorganizers: dict[str, ReorganizerProcess] = {}
        self.read = {"fields": 0, "image": 0}
        """Bytes its reorganizers read so far: backbone fields, and images for the encoder."""

    def prepare(self, phase: Phase) -> dict[str, int]:
        """Fresh reorganizer processes on the phase's rings (NOTE [ Warm-up step ]); their pids."""
        self.close()
        rings, backend = self.rings[phase.regime], self.work.store.backend
        for (d, c), spec in rings.backbone.items():
            self.reorganizers[f"dp{d}cp{c}"] = ReorganizerProcess(
                backend, spec, liveness_timeout_s=LIVENESS_S
            )
        for r, spec in enumerate(rings.encoder):
            self.reorganizers[f"vision{r}"] = ReorganizerProcess(
                backend, spec, liveness_timeout_s=LIVENESS_S
            )
        return {name: r.pid or 0 for name, r in self.reorganizers.items()}

    def submit(self, phase: Phase, step: int) -> None:
        """Plan ``step`` and queue it, in the order the ranks consume it: the encoder ranks'
        micro-batches first (TP0/CP0 takes its encoder rank's before any backbone one, and its
        group's ring stalls its TP peer until it does), then every group's."""
        if step >= len(self.work.plans):
            return
        plan = self.work.plan(step, f"{phase.name}.{step}")
        for rank_plan in plan.encoder(ENCODER.name).ranks:
            self.reorganizers[f"vision{rank_plan.dp_rank}"].submit(plan.minibatch_id, rank_plan)
        for consumer in plan.consumers:
            self.reorganizers[f"dp{consumer.dp_rank}cp{consumer.cp_rank}"].submit(
                plan.minibatch_id, consumer
            )

    def fill_s(self) -> float:
        """Thread CPU seconds the current reorganizers spent filling slots so far."""
        return sum(reorganizer.fill_s for reorganizer in self.reorganizers.values())

    def close(self) -> None:
        for name, reorganizer in self.reorganizers.items():
            self.read["image" if name.startswith(ENCODER.name) else "fields"] += (
                reorganizer.bytes_read
            )
            reorganizer.close()
        self.reorganizers.clear()


def _tq_host(sizes: Sizes, config_out: Any, stop: Any) -> None:
    """Runs Ray and TransferQueue for the TQ phases, loaded with every step's trajectories plus
    one spare step (a loader worker fetching ahead past the last step takes rows first come first
    served, so without spares another DP rank could starve); stops them when told."""
    from transfer_queue import RankAwareSampler

    die_with_parent()  # a killed benchmark stops Ray too (its finally below)

    from knitkit.integration.transferqueue import (
        put_trajectories,
        start_transfer_queue,
        stop_transfer_queue,
    )

    connection = start_transfer_queue(sampler=RankAwareSampler)
    try:
        client = connection.client()
        spare = 1
        put_trajectories(
            client, trajectories(sizes, WARMUP_STEPS + sizes.steps + spare), TQ_PARTITION
        )
        client.close()
        config_out.put(connection.config)
        stop.wait(BARRIER_TIMEOUT_S * 4)
    finally:
        stop_transfer_queue()


@dataclass(slots=True)
class _PhaseRecord:
    """What the driver saw of one phase: step wall times and CPU seconds per process key."""

    walls: list[float]
    cpu: dict[str, float]
    fill_s: float = 0.0
    """knitkit's reorganizers' thread CPU in their fills over the same window (NOTE [ Fill time ]
    in knitkit/storage/delivery/reorganizer.py), read from their rings with the CPU clocks."""


def run_delivery(
    work: Workload, sizes: Sizes, with_tq: bool, methods: tuple[str, ...] = METHODS
) -> dict[str, float]:
    """Every phase of the schedule on one workload with real rank processes; figures by key."""
    plans = work.plans
    backbone_bytes, encoder_bytes, image_bytes = slot_bytes(work.store, plans)
    ctx = mp.get_context("spawn")
    phases = schedule(with_tq, methods)
    with_tq = any(p.method == "transferqueue" for p in phases)
    barrier, results = ctx.Barrier(len(RANKS) + 1), ctx.Queue()
    tq_config = ctx.Queue() if with_tq else None
    rings = {r: RingSet.new(DEPTH[r], backbone_bytes, encoder_bytes) for r in REGIMES}
    peers = TOPOLOGY.cp * TOPOLOGY.tp - 1
    image_rings = [
        {r: RingSpec.new(num_slots=2, slot_bytes=image_bytes, num_consumers=peers) for r in REGIMES}
        for _ in range(TOPOLOGY.dp)
    ]
    bcast_image_rings = [
        {
            r: RingSpec.new(num_slots=2, slot_bytes=image_bytes, num_consumers=TOPOLOGY.cp - 1)
            for r in REGIMES
        }
        for _ in range(TOPOLOGY.dp)
    ]
    bcast = {
        (d, c): {r: _Broadcast(ctx, DEPTH[r] + 1, backbone_bytes, TOPOLOGY.tp - 1) for r in REGIMES}
        for d in range(TOPOLOGY.dp)
        for c in range(TOPOLOGY.cp)
    }
    if removed := remove_dead_channels():
        progress(f"removed {len(removed)} broadcast segments of dead runs")
    for channels in bcast.values():
        for channel in channels.values():
            channel.create()
    knitkit = _Knitkit(work, rings)
    processes: list[Any] = []
    tq_process, tq_stop = None, ctx.Event()
    records: dict[str, _PhaseRecord] = {}
    meter = CpuMeter()
    memcpy: list[float] = []
    try:
        for rank in RANKS:
            setup = RankSetup(
                rank,
                work.store.backend,
                plans,
                rings,
                image_rings[rank.dp],
                bcast[(rank.dp, rank.cp)],
                bcast_image_rings[rank.dp],
                sizes,
                phases,
                tq_config,
            )
            process = ctx.Process(target=rank_main, args=(setup, barrier, results))
            process.start()
            processes.append(process)
        pids = {rank_name(r): p.pid for r, p in zip(RANKS, processes, strict=True)}
        barrier.wait(BARRIER_TIMEOUT_S)  # ranks ready (the oracle's micro-batches packed)
        for phase in phases:
            progress(f"{phase.name}")
            involved = _Processes(pids)
            if phase.method == "knitkit":
                involved.reorganizers = knitkit.prepare(phase)
                memcpy.append(memcpy_rate())
            else:
                knitkit.close()
            if phase.method == "transferqueue":
                if tq_process is None:
                    config_out = ctx.Queue()
                    tq_process = ctx.Process(target=_tq_host, args=(sizes, config_out, tq_stop))
                    tq_process.start()
                    config = config_out.get(timeout=BARRIER_TIMEOUT_S)
                    assert tq_config is not None
                    for _ in RANKS:
                        tq_config.put(config)
                    progress("TransferQueue started and loaded")
                involved.services = tq_process.pid
            elif tq_process is not None:
                tq_stop.set()
                tq_process.join(120)
                tq_process = None
            records[phase.name] = _run_phase(phase, barrier, involved, meter, knitkit, len(plans))
        got = [results.get(timeout=BARRIER_TIMEOUT_S) for _ in RANKS]
        progress("delivery done")
    except BaseException:
        barrier.abort()
        raise
    finally:
        knitkit.close()
        if tq_process is not None:
            tq_stop.set()
            tq_process.join(120)
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
        for channels in bcast.values():
            for channel in channels.values():
                channel.unlink()
    memcpy_bps = statistics.median(memcpy) if memcpy else 0.0  # measured in knitkit phases
    return figures_of(work, phases, records, got, knitkit.read, memcpy_bps)


def _run_phase(
    phase: Phase, barrier: Any, involved: _Processes, meter: CpuMeter, knitkit: _Knitkit, count: int
) -> _PhaseRecord:
    """The driver's side of one phase (see ``_Steps``): CPU clocks read around the measured
    steps while every rank waits; each measured step's wall time between its step barriers."""

    def wait() -> None:
        barrier.wait(BARRIER_TIMEOUT_S)

    wait()  # ready
    wait()  # start
    ahead = phase.method == "knitkit" and phase.computes
    if ahead:
        knitkit.submit(phase, 0)
    marks, before, fill_before = [], {}, 0.0
    for step in range(count):
        if step == 1:
            wait()
            before = involved.read(meter, driver_last=True)
            fill_before = knitkit.fill_s()
        wait()
        marks.append(time.perf_counter())
        if phase.method == "knitkit":
            knitkit.submit(phase, step + 1 if ahead else step)
    wait()
    marks.append(time.perf_counter())
    fill = knitkit.fill_s() - fill_before
    after = involved.read(meter, driver_last=False)
    wait()
    wait()  # done
    cpu = {key: after[key] - before.get(key, 0.0) for key in after}
    return _PhaseRecord(list(np.diff(marks[1:])), cpu, fill)


def figures_of(
    work: Workload,
    phases: list[Phase],
    records: dict[str, _PhaseRecord],
    got: list[tuple[RankPosition, dict[str, tuple[list[float], float]], dict[str, dict[str, int]]]],
    knitkit_read: dict[str, int],
    memcpy_bps: float,
) -> dict[str, float]:
    """The contract's keys from the phases' records and the ranks' reports."""
    steps = len(work.plans) - WARMUP_STEPS  # measured steps
    consumed = sum(work.consumed.values())
    figures: dict[str, float] = {
        "steps": steps,
        "micro_batches_per_step": work.plans[0].num_micro_batches,
        "bytes_consumed_per_step": consumed / len(work.plans),
    }
    for phase in phases:  # CPU of the ranks' compute is not the data path's
        for rank, report, _ in got:
            records[phase.name].cpu[f"rank.{rank_name(rank)}"] -= report[phase.name][1]
    oracle = [p.name for p in phases if p.method == ORACLE]
    figures["oracle.step_wall_s"] = oracle_wall = statistics.median(
        w for name in oracle for w in records[name].walls
    )
    medians = [statistics.median(records[name].walls) for name in oracle]
    figures["oracle.step_wall_spread"] = (max(medians) - min(medians)) / oracle_wall
    figures["oracle.cpu_s_per_step"] = sum(sum(records[name].cpu.values()) for name in oracle) / (
        len(oracle) * steps
    )
    figures["oracle.compute_s_per_step"] = statistics.median(
        report[name][1] / steps for _, report, _ in got for name in oracle
    )  # one rank's thread
    for method in dict.fromkeys(p.method for p in phases if p.method != ORACLE):
        totals: dict[str, float] = {}
        for regime in REGIMES:
            name = f"{regime}.{method}"
            waits = np.array([report[name][0] for _, report, _ in got])  # ranks x steps
            figures[f"{name}.exposed_s_per_step"] = float(np.median(waits.max(axis=0)))
            figures[f"{name}.step_wall_s"] = statistics.median(records[name].walls)
            figures[f"{name}.cpu_s_per_step"] = sum(records[name].cpu.values()) / steps
            for role, seconds in _by_role(records[name].cpu).items():
                figures[f"{name}.cpu_s_per_step.{role}"] = seconds / steps
            for key, seconds in records[name].cpu.items():
                totals[key] = totals.get(key, 0.0) + seconds
            if regime != "eager":
                figures[f"{name}.step_wall_overhead"] = (
                    figures[f"{name}.step_wall_s"] / oracle_wall - 1
                )
        per_step = len(REGIMES) * steps
        figures[f"{method}.cpu_s_per_step"] = sum(totals.values()) / per_step
        for key, seconds in totals.items():
            figures[f"{method}.cpu_s_per_step.{key}"] = seconds / per_step
        for role, seconds in _by_role(totals).items():
            figures[f"{method}.cpu_s_per_step.{role}"] = seconds / per_step
        figures[f"{method}.step_wall_s"] = figures[f"lookahead.{method}.step_wall_s"]
        figures[f"{method}.step_wall_overhead"] = figures[f"lookahead.{method}.step_wall_overhead"]
        if method == "knitkit":  # every knitkit phase reads each step once
            by_kind = {kind: n / len(REGIMES) for kind, n in knitkit_read.items()}
        else:  # sample-level: one regime's reads; TQ: what it moved in the eager regime
            by_kind = {k: sum(r[method][k] for _, _, r in got) for k in ("fields", "image")}
        figures[f"{method}.bytes_read_ratio"] = sum(by_kind.values()) / consumed
        for kind, nbytes in by_kind.items():
            figures[f"{method}.bytes_read_ratio.{kind}"] = nbytes / work.consumed[kind]
    if "knitkit.cpu_s_per_step" in figures:
        delivered = sum(knitkit_read.values()) / len(REGIMES) / len(work.plans)
        rate = delivered / figures["knitkit.cpu_s_per_step"]
        figures["knitkit.delivered_gbps"] = rate / 1e9
        figures["memcpy_gbps"] = memcpy_bps / 1e9
        figures["knitkit.delivered_fraction_of_memcpy"] = rate / memcpy_bps
        packing = delivered / figures["knitkit.cpu_s_per_step.reorganizers"]  # their CPU alone
        figures["knitkit.delivered_fraction_of_memcpy.reorganizers"] = packing / memcpy_bps
        eager = delivered / figures["eager.knitkit.cpu_s_per_step"]  # steps with no compute
        figures["eager.knitkit.delivered_fraction_of_memcpy"] = eager / memcpy_bps
        fills = {r: records[f"{r}.knitkit"].fill_s / steps for r in REGIMES}
        for regime, fill in fills.items():
            figures[f"{regime}.knitkit.fill_cpu_s_per_step"] = fill
        figures["knitkit.fill_cpu_s_per_step"] = fill = statistics.mean(fills.values())
        floor = fill + figures["oracle.cpu_s_per_step"]  # NOTE [ Delivery's floor ]
        figures["knitkit.delivered_fraction_of_memcpy.fills"] = delivered / fill / memcpy_bps
        figures["knitkit.delivered_fraction_of_memcpy.ceiling"] = delivered / floor / memcpy_bps
        eager_floor = fills["eager"] + figures["oracle.cpu_s_per_step"]
        figures["eager.knitkit.delivered_fraction_of_memcpy.ceiling"] = (
            delivered / eager_floor / memcpy_bps
        )
    return figures


def _by_role(cpu: dict[str, float]) -> dict[str, float]:
    """CPU seconds per kind of process: driver, ranks, reorganizers, services."""
    out: dict[str, float] = {}
    for key, seconds in cpu.items():
        role = key.split(".")[0]
        role = role if role in ("driver", "services") else f"{role}s"
        out[role] = out.get(role, 0.0) + seconds
    return out


def memcpy_rate(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per CPU second of a single-thread memcpy between two pre-touched buffers far larger
    than the last-level cache (so it streams from DRAM like the store's bytes); the median."""
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.ones(nbytes, dtype=np.uint8)
    rates = []
    for _ in range(repeats):
        start = time.thread_time()
        np.copyto(target, source)
        rates.append(nbytes / (time.thread_time() - start))
    return statistics.median(rates)


ENGINES = ("ray", "mooncake")
"""Engine backends whose sliced reads ``knitkit.integration.sliced_read.measure`` times."""


def sliced_read_fractions(sizes: Sizes) -> dict[str, float]:
    """Throughput of CP-chunk range reads through each backend against a plain copy of the SAME
    bytes from the same place: a memcpy out of the stored array (memory, shm) or a raw
    ``os.preadv`` of the same file ranges (disk, offsets from the header) from the page cache,
    and cold (``disk_cold``: both after ``posix_fadvise(DONTNEED)`` of the shard files)."""
    from knitkit.storage import MemoryBackend, SafetensorsBackend
    from knitkit.storage.planning import cp_chunks

    rng = np.random.default_rng(0)
    shape = (sizes.sliced_units, sizes.sliced_rows, 48, 8)
    source = rng.integers(0, 256, shape, dtype=np.uint8)
    ranges = cp_chunks(sizes.sliced_rows, 2, 0)
    out = np.ones((shape[0], sum(b - a for a, b in ranges), *shape[2:]), dtype=np.uint8)
    keys = [UnitKey(f"t{i}", "routing") for i in range(shape[0])]
    pieces = [
        (i, a, b, sum(y - x for x, y in ranges[:j]))
        for i in range(shape[0])
        for j, (a, b) in enumerate(ranges)
    ]
    from knitkit.types import UnitRead

    reads = [UnitRead(key, ranges) for key in keys]
    outs = list(out)
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        backends: dict[str, Any] = {
            "memory": MemoryBackend(),
            "shm": SharedMemoryBackend(slab_bytes=256 << 20),
            "disk": SafetensorsBackend(os.path.join(tmp, "shards"), shard_bytes=64 << 20),
        }
        for name, backend in backends.items():
            for key, unit in zip(keys, source, strict=True):
                backend.put(key, unit)

            def sliced(backend=backend) -> None:
                backend.read_many(reads, outs)

            if name == "disk":
                backend.flush()
                results = _disk_fractions(
                    backend.directory, keys, pieces, out, sliced, sizes.repeats
                )
            else:
                views = [backend.view(k) for k in keys]
                results = {
                    name: time_ratio(
                        lambda views=views: _copy_pieces(views, pieces, out),
                        sliced,
                        sizes.repeats,
                    )
                }
            for label, fraction in results.items():
                figures[f"sliced_read.{label}.fraction_of_ceiling"] = fraction
            backend.close()
    return figures


def _disk_fractions(
    directory: str,
    keys: list[UnitKey],
    pieces: list[tuple[int, int, int, int]],
    out: np.ndarray,
    sliced: Callable[[], None],
    repeats: int,
) -> dict[str, float]:
    """Disk sliced reads against raw ``preadv`` of the same ranges: warm (page cache) and cold."""
    read, fds = _raw_preads(directory, keys, pieces, out)
    drop = _page_cache_dropper(directory)

    def read_cold() -> None:
        drop()
        read()

    def sliced_cold() -> None:
        drop()
        sliced()

    try:
        return {
            "disk": time_ratio(read, sliced, repeats),
            "disk_cold": time_ratio(read_cold, sliced_cold, repeats),
        }
    finally:
        for fd in fds:
            os.close(fd)


def _page_cache_dropper(directory: str) -> Callable[[], None]:
    """Evict the shard files from the page cache (fsync first, so no dirty page stays)."""
    shards = glob.glob(os.path.join(directory, "*.safetensors"))

    def drop() -> None:
        for shard in shards:
            fd = os.open(shard, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    return drop


def _copy_pieces(
    views: list[np.ndarray], pieces: list[tuple[int, int, int, int]], out: np.ndarray
) -> None:
    for i, a, b, row in pieces:
        np.copyto(out[i, row : row + b - a], views[i][a:b])


def _raw_preads(
    directory: str, keys: list[UnitKey], pieces: list[tuple[int, int, int, int]], out: np.ndarray
) -> tuple[Callable[[], None], list[int]]:
    """Plain ``os.preadv`` of the same file ranges the disk backend reads (offsets from headers),
    and the file descriptors to close afterwards."""
    from knitkit.storage.backends import read_header

    entries = {}
    for shard in glob.glob(os.path.join(directory, "*.safetensors")):
        entries.update(read_header(shard)[0])
    fds = {shard: os.open(shard, os.O_RDONLY) for shard in {e.shard for e in entries.values()}}
    row_bytes = out[0, 0].nbytes

    def read() -> None:
        for i, a, b, row in pieces:
            entry = entries[keys[i]]
            target = out[i, row : row + b - a].data
            os.preadv(fds[entry.shard], [target], entry.offset + a * row_bytes)

    return read, list(fds.values())


def main() -> None:
    end_on_sigterm()  # a SIGTERM runs the cleanup: ranks, reorganizers, Ray (lifetime.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the full run's step shape and every key, over 3 steps instead of 8",
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures as one flat JSON object")
    parser.add_argument("--skip-tq", action="store_true", help="leave out TransferQueue (no Ray)")
    parser.add_argument(
        "--skip-engines", action="store_true", help="leave out the Ray and Mooncake sliced reads"
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated methods to run (a development aid: a figure needs every method "
        "it compares; default: all of them)",
    )
    args = parser.parse_args()
    methods = tuple(m for m in METHODS if m in args.methods.split(","))
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown or not methods:
        parser.error(f"--methods {args.methods!r}: pick from {','.join(METHODS)}")
    sizes = QUICK if args.quick else FULL
    figures: dict[str, float] = {"loadavg_1m_at_start": os.getloadavg()[0]}
    progress("planner (in a fresh process, before the other phases; process time)")
    figures.update(planner_figures(clock=time.process_time))
    work = build_workload(sizes)
    progress(f"stored {sizes.steps} steps of trajectories, planned each")
    try:
        figures.update(run_delivery(work, sizes, not args.skip_tq, methods))
    finally:
        work.store.backend.close()
    figures["matmul_gflop_per_step"] = 2 * sizes.matmul**3 * sizes.matmuls_per_step / 1e9
    progress("sliced reads")
    figures.update(sliced_read_fractions(sizes))
    skipped: dict[str, str] = {}
    if not args.skip_engines:
        from knitkit.integration.sliced_read import measure_engines

        progress(f"sliced reads on {', '.join(ENGINES)}")
        engine_figures, skipped = measure_engines(list(ENGINES))
        figures.update(engine_figures)
    finish(figures, print_table, skipped, args.json)


def print_table(figures: dict[str, float]) -> None:
    print(
        f"DP2 x CP2 x TP2 ranks, GRPO groups of 8 with images, {figures['steps']:.0f} steps of "
        f"{figures['micro_batches_per_step']:.0f} micro-batches, "
        f"{figures['bytes_consumed_per_step'] / 2**20:.1f} MiB consumed per step; compute "
        f"{figures['matmul_gflop_per_step']:.0f} GFLOP per rank and step "
        f"({figures['oracle.compute_s_per_step']:.2f} s of a rank's thread); oracle step "
        f"{figures['oracle.step_wall_s']:.3f} s"
    )
    header = f"{'method':<20}{'eager s':>9}{'ahead1 s':>10}{'ahead2 s':>10}{'step s':>8}"
    print(header + f"{'overhead':>10}{'ahead2':>8}{'CPU s/step':>12}{'read/consumed':>15}")
    for method in METHODS:
        if f"{method}.bytes_read_ratio" not in figures:
            continue
        print(
            f"{method:<20}{figures[f'eager.{method}.exposed_s_per_step']:>9.4f}"
            f"{figures[f'lookahead.{method}.exposed_s_per_step']:>10.4f}"
            f"{figures[f'lookahead2.{method}.exposed_s_per_step']:>10.4f}"
            f"{figures[f'{method}.step_wall_s']:>8.3f}"
            f"{figures[f'{method}.step_wall_overhead']:>10.1%}"
            f"{figures[f'lookahead2.{method}.step_wall_overhead']:>8.1%}"
            f"{figures[f'{method}.cpu_s_per_step']:>12.3f}"
            f"{figures[f'{method}.bytes_read_ratio']:>15.2f}"
        )
    knitkit = figures.get("knitkit.cpu_s_per_step")
    for method in METHODS[1:]:
        if knitkit and f"{method}.cpu_s_per_step" in figures:
            eager = figures[f"eager.{method}.exposed_s_per_step"]
            eager /= max(figures["eager.knitkit.exposed_s_per_step"], 1e-9)
            print(
                f"{method} / knitkit: eager exposed {eager:.1f}x, CPU per step "
                f"{figures[f'{method}.cpu_s_per_step'] / knitkit:.1f}x"
            )
    if knitkit:
        print(
            f"knitkit delivery: {figures['knitkit.delivered_gbps']:.2f} GB per CPU second of "
            f"every knitkit process, {figures['knitkit.delivered_fraction_of_memcpy']:.2f} of "
            f"memcpy ({figures['memcpy_gbps']:.1f} GB/s; reorganizers alone "
            f"{figures['knitkit.delivered_fraction_of_memcpy.reorganizers']:.2f}, their fills "
            f"alone {figures['knitkit.delivered_fraction_of_memcpy.fills']:.2f}; ceiling with "
            f"nothing but the fills and the step barriers "
            f"{figures['knitkit.delivered_fraction_of_memcpy.ceiling']:.2f})"
        )
    print(f"{'sliced read':<15}{'fraction of ceiling':>22}")
    for name in ("memory", "shm", "disk", "disk_cold", *ENGINES):
        if f"sliced_read.{name}.fraction_of_ceiling" in figures:
            print(f"{name:<15}{figures[f'sliced_read.{name}.fraction_of_ceiling']:>22.2f}")
    print(
        f"planner median (process time): {figures['planner_ms']:.1f} ms (DP32 x CP2 x TP4, 4096 "
        f"trajectories), {figures['planner_ms.dp128_16k']:.1f} ms (DP128 x CP2 x TP4, 16384)"
    )
    print(
        f"load average (1 min) at start / end: {figures['loadavg_1m_at_start']:.1f} / "
        f"{figures['loadavg_1m_at_end']:.1f} on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
