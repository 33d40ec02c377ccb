"""Transfer benchmark: knitkit vs sample-level vs TransferQueue delivery to real consumer processes.

A DP2 x CP2 x TP2 backbone (8 consumer processes) plus a DP2 vision encoder train several
mini-batches of GRPO groups of 8 trajectories with MoE routing fields ([seq, layers, top-k]) and
one image per group. Every method runs in two regimes (see benchmarks/README.md):

- eager: no compute to hide behind; a step starts when every rank is at a barrier, and its
  exposed time is how long the slowest rank waits for its data (all work counted where it
  happens: in the rank, or in helpers the rank waits for);
- lookahead: each rank "computes" every micro-batch (a sleep: GPU time costs no host CPU) and
  every method gets the same look-ahead depth of micro-batches: knitkit its reorganizers' rings,
  sample-level a prefetch thread, TransferQueue its own StreamingDataLoader worker.

Keys: ``<regime>.<method>.exposed_s_per_step`` (median over steps of the slowest rank's wait),
``<method>.cpu_s_per_step`` (CPU seconds of every process involved: ranks, reorganizers, Ray and
TQ actors, loader workers; both regimes), ``<method>.bytes_read_ratio`` (bytes read / bytes the
step consumes, images counted once; ``.fields`` and ``.image`` per field kind),
``knitkit.delivered_fraction_of_memcpy`` (bytes a rank consumes per second of plan + read + pack
work / single-thread memcpy bandwidth; ``.cold`` with the units streaming from DRAM),
``sliced_read.<backend>.fraction_of_ceiling`` (memory and shm: memcpy; disk: raw ``preadv`` of the same ranges from the page cache, and
``disk_cold`` after ``posix_fadvise(DONTNEED)``; Mooncake: whole-unit reads of the same bytes over
its transport), ``planner_ms`` and ``planner_ms.dp128_16k`` (median wall time of ``plan_minibatch``
over 15 calls, timed first, in a fresh spawned process, garbage collector on, each call with the
collection it leaves due). Every timing is a median.

    python benchmarks/transfer.py [--quick] [--json PATH] [--skip-tq] [--skip-engines]
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import psutil

from knitkit.integration.sliced_read import time_ratio
from knitkit.storage import (
    EncoderRankPlan,
    EncoderTopology,
    MiniBatchPlan,
    PlannerConfig,
    SharedMemoryBackend,
    Topology,
    TrajectoryStore,
    UnitBackend,
    plan_minibatch,
)
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
from knitkit.storage.delivery import (
    MicroBatchConsumer,
    ReorganizerHost,
    ReorganizerProcess,
    RingSpec,
)
from knitkit.storage.planning import pack_layout
from knitkit.types import UnitKey

FIELDS = ("tokens", "logprobs", "loss_mask", "routing", "topp_mask")
SCALARS = ("reward",)
TOPOLOGY = Topology(dp=2, cp=2, tp=2)
ENCODER = EncoderTopology("vision", dp=2)
METHODS = ("knitkit", "sample_level", "transferqueue")
REGIMES = ("eager", "lookahead")
DEPTH = 2
"""Look-ahead depth in micro-batches, the same for every method (knitkit: ring slots)."""
TQ_PARTITION = "transfer-bench"
TQ_IMAGE = "image"


@dataclass(frozen=True, slots=True)
class Sizes:
    """Workload of one run."""

    samples_per_minibatch: int
    group_size: int
    min_tokens: int
    max_tokens: int
    routing_layers: int
    image_patches: int
    patch_dim: int
    minibatches: int
    micro_batch_tokens: int
    compute_s: float
    """Compute per knitkit micro-batch in the look-ahead regime (per step: times their count)."""
    sliced_units: int
    sliced_rows: int
    repeats: int


FULL = Sizes(2, 8, 4096, 16384, 48, 1024, 1176, 5, 8192, 0.05, 16, 16384, 7)
QUICK = Sizes(2, 8, 1024, 4096, 12, 256, 588, 3, 2048, 0.02, 16, 8192, 5)


@dataclass(slots=True)
class Workload:
    """The stored trajectories, one plan per mini-batch and what a step consumes."""

    store: TrajectoryStore
    plans: list[MiniBatchPlan]
    trajectories: list[Any]
    metas: list[list[Any]]
    """Each step's trajectory metadata, as the planner got it."""
    consumed: dict[str, int]
    """Bytes the steps consume, per field kind ("fields": per-token and scalar; "image")."""
    config: PlannerConfig


def build_workload(sizes: Sizes) -> Workload:
    """Store trajectories in shared memory; plan each mini-batch; bytes the steps consume."""
    trajectories = synthetic_trajectories(
        sizes.samples_per_minibatch * sizes.minibatches,
        group_size=sizes.group_size,
        min_tokens=sizes.min_tokens,
        max_tokens=sizes.max_tokens,
        routing_layers=sizes.routing_layers,
        routing_topk=8,
        image_patches=sizes.image_patches,
        patch_dim=sizes.patch_dim,
    )
    store = TrajectoryStore(SharedMemoryBackend(slab_bytes=256 << 20))
    for trajectory in trajectories:
        store.write(trajectory)
    per_step = sizes.samples_per_minibatch * sizes.group_size
    config = PlannerConfig(
        token_fields=FIELDS, max_tokens_per_micro_batch=sizes.micro_batch_tokens, keep_groups=True
    )
    plans, steps, consumed = [], [], {"fields": 0, "image": 0}
    for step in range(sizes.minibatches):
        metas = store.metas([t.trajectory_id for t in trajectories[step * per_step :][:per_step]])
        steps.append(metas)
        plans.append(plan_minibatch(metas, TOPOLOGY, config, (ENCODER,), f"mb{step}"))
        fields = {UnitKey(m.trajectory_id, f) for m in metas for f in (*FIELDS, *SCALARS)}
        images = {ref.key for m in metas for ref in m.multimodal}
        consumed["fields"] += sum(store.backend.spec(k).nbytes for k in fields)
        consumed["image"] += sum(store.backend.spec(k).nbytes for k in images)
    return Workload(store, plans, trajectories, steps, consumed, config)


def slot_bytes(store: TrajectoryStore, plans: list[MiniBatchPlan]) -> tuple[int, int, int]:
    """Largest backbone micro-batch, encoder micro-batch and DP share of images (sample-level
    redistribution), so one slot of each ring fits any of them."""
    schema = store.schema(plans[0].consumers[0].micro_batches[0].sequences[0].trajectory_id)
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


@dataclass(slots=True)
class RankSetup:
    """What one rank process needs (picklable)."""

    rank: RankPosition
    backend: UnitBackend
    plans: list[MiniBatchPlan]
    backbone_ring: RingSpec
    encoder_ring: RingSpec | None
    image_ring: RingSpec
    tq_configs: Any
    compute_per_step_s: float


class _Phases:
    """The rank's side of the phase protocol: a barrier with the driver at each phase start and
    end, and in the eager regime at each step start (no step's work overlaps the previous one)."""

    def __init__(self, barrier: Any) -> None:
        self.barrier = barrier

    def steps(self, count: int, eager: bool) -> Iterator[int]:
        self.barrier.wait()
        for step in range(count):
            if eager:
                self.barrier.wait()
            yield step
        self.barrier.wait()


def rank_main(setup: RankSetup, barrier: Any, results: Any) -> None:
    """One training rank: runs every method in both regimes, reporting per-step waits."""
    rank, plans = setup.rank, setup.plans
    phases = _Phases(barrier)
    waits: dict[str, list[float]] = {}
    read: dict[str, dict[str, int]] = {}
    backbone = MicroBatchConsumer(setup.backbone_ring, rank.tp)
    encoder = MicroBatchConsumer(setup.encoder_ring, 0) if setup.encoder_ring else None
    images = _ImageShare(rank, setup.image_ring, setup.backend)
    if setup.tq_configs is not None:  # import torch / Ray / TQ while the driver starts TQ
        import transfer_queue.dataloader  # noqa: F401
    barrier.wait()

    for regime in REGIMES:
        eager = regime == "eager"
        per_mb = (
            0.0 if eager else setup.compute_per_step_s / len(plans[0].consumers[0].micro_batches)
        )
        got = []
        for step in phases.steps(len(plans), eager):
            wait = 0.0
            ranks = plans[step].encoder("vision").ranks
            for _ in ranks[rank.dp].micro_batches if encoder else ():
                start = time.perf_counter()
                assert encoder is not None
                encoder.next_micro_batch().release()
                wait += time.perf_counter() - start
            for _ in plans[step].consumer(rank.dp, rank.cp).micro_batches:
                start = time.perf_counter()
                batch = backbone.next_micro_batch()
                wait += time.perf_counter() - start
                _compute(per_mb)
                batch.release()
            got.append(wait)
        waits[f"{regime}.knitkit"] = got
    backbone.close()
    if encoder:
        encoder.close()

    raw, packed = Arena(), [Arena() for _ in range(DEPTH + 2)]
    for regime in REGIMES:
        eager = regime == "eager"
        per_mb = setup.compute_per_step_s / len(plans[0].consumers[0].micro_batches)
        got = []
        if eager:
            for step in phases.steps(len(plans), eager=True):
                start = time.perf_counter()
                group = plans[step].consumer(rank.dp, rank.cp)
                raw.reset()
                local = read_share(setup.backend, plans[step], rank, raw)
                images.share(local)
                for _ in pack_local(group, local, packed):
                    pass
                got.append(time.perf_counter() - start)
        else:
            for step in phases.steps(len(plans), eager=False):
                if step == 0:  # started with the phase, like the other methods' helpers
                    prefetched = _SampleLevelPrefetch(setup, images, raw, packed)
                wait = 0.0
                for _ in plans[step].consumer(rank.dp, rank.cp).micro_batches:
                    start = time.perf_counter()
                    prefetched.next()
                    wait += time.perf_counter() - start
                    _compute(per_mb)
                got.append(wait)
            prefetched.join()
        waits[f"{regime}.sample_level"] = got
    read["sample_level"] = _share_bytes(setup)

    if setup.tq_configs is not None:
        from knitkit.integration.transferqueue import (
            TransferQueueConnection,
            pack_streamed,
            streaming_loader,
        )

        connection = TransferQueueConnection(setup.tq_configs.get())
        rows = sum(len(mb.sequences) for c in plans[0].consumers for mb in c.micro_batches)
        rows //= TOPOLOGY.dp * TOPOLOGY.cp  # trajectories per DP rank and step
        tq_fields = [*FIELDS, *SCALARS, TQ_IMAGE]
        moved: dict[str, int] = {"fields": 0, "image": 0}
        for regime in REGIMES:
            eager = regime == "eager"
            per_mb = setup.compute_per_step_s / rows
            got = []
            for step in phases.steps(len(plans), eager):
                if step == 0:  # started with the phase, like the other methods' helpers
                    loader = iter(
                        streaming_loader(
                            connection,
                            rank,
                            tq_fields,
                            rows,
                            TQ_PARTITION,
                            regime,
                            0 if eager else DEPTH,
                        )
                    )
                wait = 0.0
                for index in range(rows):
                    start = time.perf_counter()
                    batch, _ = next(loader)
                    _, _, sizes = pack_streamed(
                        batch, rank, TOPOLOGY, FIELDS, SCALARS, packed[index % len(packed)], index
                    )
                    wait += time.perf_counter() - start
                    _compute(0.0 if eager else per_mb)
                    if eager:
                        for name, nbytes in sizes.items():
                            moved["image" if name == TQ_IMAGE else "fields"] += nbytes
                got.append(wait)
            waits[f"{regime}.transferqueue"] = got
            del loader
        read["transferqueue"] = moved
    images.close()
    results.put((rank, waits, read))


def _compute(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class _ImageShare:
    """Sample-level redistribution of images: TP0/CP0 publishes its DP share's images, the DP
    group's other ranks copy them (into the step's arena).

    TP0/CP0 owns the ring (made before the ranks' start barrier, so the peers attach after it)
    and publishes each step's images as one micro-batch of whole units, read from the store."""

    def __init__(self, rank: RankPosition, spec: RingSpec, backend: UnitBackend) -> None:
        self.rank, self.spec = rank, spec
        self.out: ReorganizerHost | None = None
        self.into: MicroBatchConsumer | None = None
        self.shared = 0
        if rank.reads_multimodal:
            self.out = ReorganizerHost(backend, spec, owns_ring=True)

    def share(self, local: LocalTrajectories) -> None:
        if self.out is not None:
            keys = tuple(k for k in local.units if k.field in ("image", "video"))
            plan = EncoderRankPlan("images", self.rank.dp, (keys,))
            self.out.deliver(f"images{self.shared}", plan)
        else:
            if self.into is None:
                self.into = MicroBatchConsumer(
                    self.spec, self.rank.cp * TOPOLOGY.tp + self.rank.tp - 1
                )
            receive_multimodal(self.into, local)
        self.shared += 1

    def close(self) -> None:
        if self.out is not None:
            self.out.finish()
            self.out.close()
        elif self.into is not None:
            self.into.close()


class _SampleLevelPrefetch:
    """A careful sample-level loader with look-ahead: a thread reads each step's share, shares the
    images and packs micro-batch by micro-batch into reused buffers, at most ``DEPTH`` ahead."""

    def __init__(
        self, setup: RankSetup, images: _ImageShare, raw: Arena, packed: list[Arena]
    ) -> None:
        self._ready: queue.Queue[object] = queue.Queue(maxsize=DEPTH)
        self._args = (setup, images, raw, packed)
        self._thread = threading.Thread(target=self._run, name="sample-level-prefetch")
        self._thread.start()

    def _run(self) -> None:
        setup, images, raw, packed = self._args
        try:
            for plan in setup.plans:
                raw.reset()
                local = read_share(setup.backend, plan, setup.rank, raw)
                images.share(local)
                for item in pack_local(plan.consumer(setup.rank.dp, setup.rank.cp), local, packed):
                    self._ready.put(item)
        except BaseException as exc:  # carried to the consumer, raised there
            self._ready.put(exc)

    def next(self) -> object:
        item = self._ready.get(timeout=600)
        if isinstance(item, BaseException):
            raise item
        return item

    def join(self) -> None:
        self._thread.join(timeout=600)


def _share_bytes(setup: RankSetup) -> dict[str, int]:
    """Bytes one sample-level rank reads per field kind over all steps (what ``read_share`` reads)."""
    out = {"fields": 0, "image": 0}
    for plan in setup.plans:
        for key in share_reads(plan, setup.rank):
            kind = "image" if key.field in ("image", "video") else "fields"
            out[kind] += setup.backend.spec(key).nbytes
    return out


def _progress(message: str, start: float = time.perf_counter()) -> None:
    print(f"[{time.perf_counter() - start:6.1f} s] {message}", file=sys.stderr, flush=True)


class CpuMeter:
    """CPU seconds (user + system) of sets of processes, read from /proc through psutil."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def snapshot(self, pids: set[int]) -> dict[int, float]:
        out = {}
        for pid in pids:
            try:
                proc = self._procs.setdefault(pid, psutil.Process(pid))
                times = proc.cpu_times()
                out[pid] = times.user + times.system
            except psutil.Error:
                continue
        return out

    @staticmethod
    def spent(before: dict[int, float], after: dict[int, float]) -> float:
        return sum(after[pid] - before.get(pid, 0.0) for pid in after)


def _descendants(pids: set[int]) -> set[int]:
    out = set(pids)
    for pid in pids:
        try:
            out |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            continue
    return out


def run_delivery(work: Workload, sizes: Sizes, with_tq: bool) -> dict[str, float]:
    """Every method in both regimes on one workload, consumers as real processes; figures by key."""
    store, plans = work.store, work.plans
    backbone_bytes, encoder_bytes, image_bytes = slot_bytes(store, plans)
    ctx = mp.get_context("spawn")
    ranks = [RankPosition(d, c, t) for d in range(2) for c in range(2) for t in range(2)]
    barrier, results = ctx.Barrier(len(ranks) + 1), ctx.Queue()
    tq_configs = ctx.Queue() if with_tq else None
    rings = {
        (d, c): RingSpec.new(num_slots=DEPTH, slot_bytes=backbone_bytes, num_consumers=TOPOLOGY.tp)
        for d in range(2)
        for c in range(2)
    }
    encoder_rings = [
        RingSpec.new(num_slots=DEPTH, slot_bytes=encoder_bytes, num_consumers=1) for _ in range(2)
    ]
    peers = TOPOLOGY.cp * TOPOLOGY.tp - 1
    image_rings = [
        RingSpec.new(num_slots=2, slot_bytes=image_bytes, num_consumers=peers)
        for _ in range(TOPOLOGY.dp)
    ]
    reorganizers = [ReorganizerProcess(store.backend, spec) for spec in rings.values()]
    reorganizers += [ReorganizerProcess(store.backend, spec) for spec in encoder_rings]
    compute_per_step = sizes.compute_s * plans[0].num_micro_batches
    processes, connection = [], None
    meter, cpu = CpuMeter(), dict.fromkeys(METHODS, 0.0)
    phase_waits: dict[str, float] = {}
    try:
        for rank in ranks:
            setup = RankSetup(
                rank,
                store.backend,
                plans,
                rings[(rank.dp, rank.cp)],
                encoder_rings[rank.dp] if rank.reads_multimodal else None,
                image_rings[rank.dp],
                tq_configs,
                compute_per_step,
            )
            process = ctx.Process(target=rank_main, args=(setup, barrier, results))
            process.start()
            processes.append(process)
        if tq_configs is not None:
            from transfer_queue import RankAwareSampler

            from knitkit.integration.transferqueue import put_trajectories, start_transfer_queue

            connection = start_transfer_queue(sampler=RankAwareSampler)
            client = connection.client()
            # one spare step: a loader worker fetching ahead past the last step takes its rows
            # first come first served, so without spares another DP rank could starve
            spare = [
                replace(t, trajectory_id=f"{t.trajectory_id}-spare")
                for t in work.trajectories[: len(work.metas[0])]
            ]
            put_trajectories(client, [*work.trajectories, *spare], TQ_PARTITION)
            client.close()
            for _ in ranks:
                tq_configs.put(connection.config)
            _progress("TransferQueue started and loaded")
        barrier.wait(timeout=600)
        rank_pids = {p.pid for p in processes if p.pid is not None}
        helper_pids = {r.pid for r in reorganizers if r.pid is not None}
        for method in METHODS if with_tq else METHODS[:2]:
            for regime in REGIMES:
                _progress(f"{regime} {method}")
                started = time.perf_counter()
                everyone = _descendants({os.getpid()})
                involved = _descendants(rank_pids)
                if method == "knitkit":
                    involved |= helper_pids
                elif method == "transferqueue":
                    involved |= everyone - _descendants(helper_pids) - {os.getpid()}
                before = meter.snapshot(involved)
                barrier.wait(timeout=600)
                for plan in plans:
                    if regime == "eager":
                        barrier.wait(timeout=600)
                    if method == "knitkit":
                        _submit(reorganizers, plan)
                barrier.wait(timeout=900)
                involved |= _descendants(rank_pids)
                cpu[method] += meter.spent(before, meter.snapshot(involved))
                phase_waits[f"{regime}.{method}"] = time.perf_counter() - started
        got = [results.get(timeout=600) for _ in ranks]
        _progress("delivery done")
        knitkit_read = {
            "fields": sum(r.bytes_read for r in reorganizers[:4]) / len(REGIMES),
            "image": sum(r.bytes_read for r in reorganizers[4:]) / len(REGIMES),
        }
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
        for reorganizer in reorganizers:
            reorganizer.close()
        if connection:
            from knitkit.integration.transferqueue import stop_transfer_queue

            stop_transfer_queue()
    figures: dict[str, float] = {
        "steps": len(plans),
        "micro_batches_per_step": plans[0].num_micro_batches,
        "bytes_consumed_per_step": sum(work.consumed.values()) / len(plans),
        "compute_s_per_step": compute_per_step,
    }
    consumed = sum(work.consumed.values())
    for method in METHODS if with_tq else METHODS[:2]:
        for regime in REGIMES:
            per_step = np.array([w[f"{regime}.{method}"] for _, w, _ in got])  # ranks x steps
            figures[f"{regime}.{method}.exposed_s_per_step"] = float(
                np.median(per_step.max(axis=0))
            )
        figures[f"{method}.cpu_s_per_step"] = cpu[method] / (len(REGIMES) * len(plans))
        by_kind = (
            knitkit_read
            if method == "knitkit"
            else {k: sum(r[method][k] for _, _, r in got) for k in ("fields", "image")}
        )
        figures[f"{method}.bytes_read_ratio"] = sum(by_kind.values()) / consumed
        for kind, nbytes in by_kind.items():
            figures[f"{method}.bytes_read_ratio.{kind}"] = nbytes / work.consumed[kind]
    return figures


def _submit(reorganizers: list[ReorganizerProcess], plan: MiniBatchPlan) -> None:
    for reorganizer, group in zip(reorganizers[:4], plan.consumers, strict=True):
        reorganizer.submit(plan.minibatch_id, group)
    for reorganizer, rank_plan in zip(reorganizers[4:], plan.encoder("vision").ranks, strict=True):
        reorganizer.submit(plan.minibatch_id, rank_plan)


def delivered_fraction(work: Workload, repeats: int) -> dict[str, float]:
    """Median over steps of the bytes the step delivers to its (DP, CP) groups / (median plan
    time of the step, counted once as the plan is made once for every rank, + the sum over its
    groups of the median time of the group's reorganizer reading and packing every micro-batch
    into a ring and a consumer taking them), over single-thread memcpy bandwidth
    (``memcpy_ceiling``, timed alternately with the deliveries). Runs in this process with the
    real reorganizer (its host: ring, publisher, loop) and consumer.

    Deliveries of one group repeat back to back, so part of their 2 x ~15 MB (stored units and
    ring slots) stays in the last-level cache; ``.cold`` times each delivery right after the
    256 MiB memcpy instead, i.e. with the units and the ring streaming from DRAM like the
    memcpy itself. Every time here is CPU time of this thread (``time.thread_time``): the
    figure is about work, and on a shared machine wall time adds whatever other processes take
    from the core (memory bandwidth they take still shows, on both sides of the ratio)."""
    store = work.store
    rates: dict[str, list[float]] = {"": [], ".cold": []}
    memcpys = []
    copy_bytes, copy = memcpy_ceiling()
    for plan, metas in zip(work.plans, work.metas, strict=True):

        def replan(metas: list[Any] = metas) -> None:
            plan_minibatch(metas, TOPOLOGY, work.config, (ENCODER,))

        (plan_s,) = median_seconds([replan], repeats, time.thread_time)
        step_bytes, spent = 0, {suffix: plan_s for suffix in rates}
        for group in plan.consumers:
            schema = store.schema(group.micro_batches[0].sequences[0].trajectory_id)
            layouts = [pack_layout(mb, schema) for mb in group.micro_batches]
            slot = max(layout.nbytes for layout in layouts)
            spec = RingSpec.new(num_slots=len(layouts), slot_bytes=slot, num_consumers=1)
            host = ReorganizerHost(store.backend, spec, owns_ring=True)
            consumer = MicroBatchConsumer(spec, 0)

            def deliver(group=group, consumer=consumer, host=host) -> None:
                host.deliver("delivered-fraction", group)
                for _ in group.micro_batches:
                    consumer.next_micro_batch().release()

            (warm_s,) = median_seconds([deliver], repeats, time.thread_time)
            cold_s, copy_s = median_seconds([deliver, copy], repeats, time.thread_time)
            host.finish()
            consumer.close()
            host.close()
            step_bytes += sum(layout.nbytes for layout in layouts)
            spent[""] += warm_s
            spent[".cold"] += cold_s
            memcpys.append(copy_bytes / copy_s)
        for suffix, seconds in spent.items():
            rates[suffix].append(step_bytes / seconds)
    memcpy = statistics.median(memcpys)
    figures = {"memcpy_gbps": memcpy / 1e9}
    for suffix, rate in rates.items():
        figures[f"knitkit.delivered_fraction_of_memcpy{suffix}"] = statistics.median(rate) / memcpy
        figures[f"knitkit.delivered_gbps{suffix}"] = statistics.median(rate) / 1e9
    return figures


def memcpy_ceiling(nbytes: int = 256 << 20) -> tuple[int, Callable[[], object]]:
    """A single-thread memcpy between two pre-touched buffers 8x the last-level cache of this
    kind of machine (the store's bytes stream from DRAM, not from cache), and its byte count."""
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.ones(nbytes, dtype=np.uint8)
    return nbytes, partial(np.copyto, target, source)


def median_seconds(
    fns: list[Callable[[], object]], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """Median time on ``clock`` (wall time by default) of each of ``fns`` over ``repeats``
    rounds after one warm-up round; a round calls every function once, so figures that are
    compared see the same machine state."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times, strict=True):
            start = clock()
            fn()
            spent.append(clock() - start)
    return [statistics.median(spent) for spent in times]


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes (about 30 s here, plus Ray + TransferQueue start-up unless --skip-tq)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures as one flat JSON object")
    parser.add_argument("--skip-tq", action="store_true", help="leave out TransferQueue (no Ray)")
    parser.add_argument(
        "--skip-engines", action="store_true", help="leave out the Ray and Mooncake sliced reads"
    )
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    _progress("planner (in a fresh process, before the other phases)")
    planner = planner_figures()
    work = build_workload(sizes)
    _progress(
        f"stored {len(work.trajectories)} trajectories, planned {len(work.plans)} mini-batches"
    )
    try:
        figures = run_delivery(work, sizes, with_tq=not args.skip_tq)
        _progress("delivered fraction of memcpy")
        figures.update(delivered_fraction(work, sizes.repeats))
    finally:
        work.store.backend.close()
    _progress("sliced reads")
    figures.update(sliced_read_fractions(sizes))
    if not args.skip_engines:
        from knitkit.integration.sliced_read import measure

        for engine in ENGINES:
            _progress(f"sliced reads on {engine}")
            figures.update(measure(engine, quick=args.quick))
    figures.update(planner)
    print_table(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1, sort_keys=True)


def print_table(figures: dict[str, float]) -> None:
    print(
        f"DP2 x CP2 x TP2 consumers, GRPO groups of 8 with images, {figures['steps']:.0f} steps of "
        f"{figures['micro_batches_per_step']:.0f} micro-batches, "
        f"{figures['bytes_consumed_per_step'] / 2**20:.1f} MiB consumed per step, look-ahead "
        f"{DEPTH} micro-batches, {figures['compute_s_per_step']:.2f} s compute per step"
    )
    header = f"{'method':<15}{'eager s/step':>14}{'lookahead s/step':>18}{'CPU s/step':>12}"
    print(header + f"{'read/consumed':>15}{'fields':>9}{'image':>9}")
    for method in METHODS:
        if f"{method}.bytes_read_ratio" not in figures:
            continue
        print(
            f"{method:<15}{figures[f'eager.{method}.exposed_s_per_step']:>14.4f}"
            f"{figures[f'lookahead.{method}.exposed_s_per_step']:>18.4f}"
            f"{figures[f'{method}.cpu_s_per_step']:>12.3f}"
            f"{figures[f'{method}.bytes_read_ratio']:>15.2f}"
            f"{figures[f'{method}.bytes_read_ratio.fields']:>9.2f}"
            f"{figures[f'{method}.bytes_read_ratio.image']:>9.2f}"
        )
    for regime in REGIMES:
        knitkit = max(figures[f"{regime}.knitkit.exposed_s_per_step"], 1e-9)
        for method in METHODS[1:]:
            if f"{regime}.{method}.exposed_s_per_step" in figures:
                ratio = figures[f"{regime}.{method}.exposed_s_per_step"] / knitkit
                print(f"{regime}: exposed {method} / knitkit = {ratio:.1f}x")
    print(
        f"knitkit delivery: {figures['knitkit.delivered_gbps']:.2f} GB/s per rank, "
        f"{figures['knitkit.delivered_fraction_of_memcpy']:.2f} of memcpy; from DRAM (cold): "
        f"{figures['knitkit.delivered_gbps.cold']:.2f} GB/s, "
        f"{figures['knitkit.delivered_fraction_of_memcpy.cold']:.2f} of memcpy"
    )
    print(f"{'sliced read':<15}{'fraction of ceiling':>22}")
    for name in ("memory", "shm", "disk", "disk_cold", *ENGINES):
        if f"sliced_read.{name}.fraction_of_ceiling" in figures:
            print(f"{name:<15}{figures[f'sliced_read.{name}.fraction_of_ceiling']:>22.2f}")
    print(
        f"planner median: {figures['planner_ms']:.1f} ms (DP32 x CP2 x TP4, 4096 trajectories), "
        f"{figures['planner_ms.dp128_16k']:.1f} ms (DP128 x CP2 x TP4, 16384)"
    )


if __name__ == "__main__":
    main()
