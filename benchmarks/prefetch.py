"""Micro-batch prefetch: the MicroBatchIterator against a DataLoader with workers and a one-ahead thread (paper Fig. 11b).

Each micro-batch is prepared by a stand-in reorganizer that packs slices of trajectories out of a
/dev/shm trajectory store into a /dev/shm slot (real copies), then does a fixed amount of further
CPU work, calibrated once to Y ms in all (passes over the packed bytes: computing, never a sleep,
so preparation competes with the loop's compute for the cores as a real one does). The training step's compute is a fixed number of matmuls
(calibrated once to X ms on an idle core, then fixed: more load makes it slower, it never does
less work) that also reads every field of the micro-batch. Methods, each over the same source:

- iter: ``MicroBatchIterator(depth=2)`` (its one prefetch thread stages micro-batches ahead);
  iter1: the same at depth 1;
- thread: a careful user's one-ahead thread: it copies the next micro-batch into one of two
  reused buffers (pinned on CUDA) while the loop computes on the current one;
- dataloader: ``torch.utils.data.DataLoader(num_workers=2, pin_memory=True,
  persistent_workers=True)`` over an ``IterableDataset`` whose workers prepare alternate
  micro-batches (its default prefetch_factor of 2 per worker: up to 4 ahead, more than the
  iterator's 2); one loader per source, its workers started once and kept across mini-batches, as
  a training job keeps them across epochs.

Every method runs cold (the loop asks for the first micro-batch right after creating its loader:
the preparation of the first one is exposed; the headline) and warm (one training step of compute
between creating the loader and asking: what a loop does before a step's first micro-batch), and
an in-memory oracle runs the same compute over micro-batches already staged: a method's
``wall_overhead`` is its step time over the oracle's, minus 1. Keys: benchmarks/README.md.

    python benchmarks/prefetch.py [--quick] [--gpu] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import queue
import resource
import statistics
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from threading import Semaphore
from typing import Any

import numpy as np
import torch
from progress import Progress
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from knitkit.microbatch_iter import MicroBatchIterator, PackedMicroBatch, field_tensors
from knitkit.types import MicroBatchLayout

progress = Progress("prefetch")

MiB = 1 << 20
TRAJECTORIES = 16
METHODS = ("iter", "iter1", "thread", "dataloader")
Tensors = Mapping[str, torch.Tensor]


class ShmReorganizer:
    """Packs micro-batches of ``tokens`` tokens from 4 trajectories of a /dev/shm store into slots."""

    def __init__(self, n_micro: int, tokens: int, prep_ms: float, *, layers: int = 24) -> None:
        self.n_micro, self.tokens = n_micro, tokens
        self.store_len = 2 * tokens
        store_specs = {
            "tokens": ("int32", (TRAJECTORIES, self.store_len)),
            "logprobs": ("float32", (TRAJECTORIES, self.store_len)),
            "routing": ("uint8", (TRAJECTORIES, self.store_len, layers, 8)),
        }
        self.store_layout = MicroBatchLayout.build(store_specs)
        self.layout = MicroBatchLayout.build(
            {name: (dtype, (tokens, *shape[2:])) for name, (dtype, shape) in store_specs.items()}
        )
        self.slots = 4
        self.store = _shm(self.store_layout.nbytes)
        self.ring = _shm(self.slots * self.layout.nbytes)
        store_bytes = np.frombuffer(_buffer(self.store), np.uint8)
        store_bytes[:] = np.random.default_rng(0).integers(0, 100, store_bytes.size, np.uint8)
        del store_bytes
        self.free = Semaphore(self.slots)
        self.scratch = np.empty(self.layout.nbytes, np.uint8)
        self.passes = 0
        self.passes = _calibrate(
            lambda: next(iter(self.packed([0]))).release(), prep_ms, self.layout.nbytes
        )
        self.loader: DataLoader | None = None
        """The DataLoader baseline's loader, its workers kept across mini-batches (``LoaderLoop``)."""

    def __iter__(self) -> Iterator[PackedMicroBatch]:
        return self.packed(range(self.n_micro))

    def packed(self, indices: Iterable[int]) -> Iterator[PackedMicroBatch]:
        """Micro-batches ``indices``, each a lease on its slot (slot ``i % 4``)."""
        store = self.store_layout.numpy_views(_buffer(self.store))
        quarter = self.tokens // 4
        for i in indices:
            self.free.acquire()
            offset = (i % self.slots) * self.layout.nbytes
            slot = _buffer(self.ring)[offset : offset + self.layout.nbytes]
            packed = self.layout.numpy_views(slot)
            for part in range(4):  # 4 trajectory slices, as the planner would assign them
                traj, begin = (7 * i + part) % TRAJECTORIES, (i * 131) % (self.store_len - quarter)
                for name, dst in packed.items():
                    src = store[name][traj, begin : begin + quarter]
                    np.copyto(dst[part * quarter : (part + 1) * quarter], src)
            del packed
            flat = np.frombuffer(slot, np.uint8)
            for _ in range(self.passes):  # the rest of the preparation: fixed CPU work
                np.copyto(self.scratch, flat)
            del flat
            yield PackedMicroBatch(self.layout, slot, on_release=self.free.release)
        del store

    def close(self) -> None:
        self.loader = None  # shuts its persistent workers down
        gc.collect()  # drop finished generators' views so the mappings can close
        for segment in (self.store, self.ring):
            segment.unlink()
            with contextlib.suppress(BufferError):
                segment.close()


def _calibrate(prepare: Callable[[], None], prep_ms: float, nbytes: int) -> int:
    """Passes over the ``nbytes`` packed bytes that make ``prepare()`` (packing plus the passes)
    take ``prep_ms`` of this thread's CPU time, measured once here (then fixed, like ``Compute``)."""
    pack_ms = statistics.median(_thread_ms(prepare) for _ in range(5))
    source = np.ones(nbytes, np.uint8)
    target = np.empty_like(source)
    pass_ms = statistics.median(_thread_ms(lambda: np.copyto(target, source)) for _ in range(9))
    return max(0, round((prep_ms - pack_ms) / pass_ms))


def _thread_ms(work: Callable[[], object]) -> float:
    began = time.thread_time()
    work()
    return (time.thread_time() - began) * 1e3


def _shm(nbytes: int) -> shared_memory.SharedMemory:
    return shared_memory.SharedMemory(f"knitkit-bench-{uuid.uuid4().hex[:12]}", True, nbytes)


def _buffer(segment: shared_memory.SharedMemory) -> memoryview:
    assert segment.buf is not None, f"shared memory {segment.name} is closed"
    return segment.buf


class Compute:
    """One micro-batch's training compute: a fixed number of matmuls, calibrated once to ``ms``
    (CPU: 128x128 fp32, timed on this thread's CPU clock; CUDA: 4096x4096 bf16, timed with
    events), then reading every field of the micro-batch; ``.item()`` ends it (a loss.item())."""

    def __init__(self, ms: float, device: str) -> None:
        self.device = device
        size = 128 if device == "cpu" else 4096
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.a = torch.randn(size, size, device=device, dtype=dtype) / size**0.5
        self.reps = max(1, round(ms / self._ms_per_rep()))

    def _ms_per_rep(self, probe: int = 50) -> float:
        self._matmuls(probe)  # warm-up
        if self.device == "cpu":
            times = []
            for _ in range(5):
                began = time.thread_time()
                self._matmuls(probe)
                times.append((time.thread_time() - began) * 1e3 / probe)
            return statistics.median(times)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._matmuls(probe)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / probe

    def _matmuls(self, reps: int) -> torch.Tensor:
        x = self.a
        for _ in range(reps):
            x = torch.tanh(self.a @ x)
        return x

    def __call__(self, tensors: Tensors) -> float:
        out = self._matmuls(self.reps)[0, 0].float()
        for tensor in tensors.values():
            out = out + tensor.sum().float()
        return out.item()

    def lead_in(self, tensors: Tensors) -> None:
        """The loop's work before it asks for its first micro-batch: one step's compute."""
        self(tensors)


class OneAheadThread:
    """A careful user's prefetch: a thread copies the next micro-batch out of the source into one
    of two reused buffers (pinned on CUDA) while the loop computes on the current one; the loop
    copies a buffer to the device itself (non-blocking from pinned memory)."""

    def __init__(self, source: ShmReorganizer, device: str) -> None:
        pinned = device != "cpu"
        self.layout, self.device = source.layout, device
        self.buffers = [
            torch.empty(source.layout.nbytes, dtype=torch.uint8, pin_memory=pinned) for _ in (0, 1)
        ]
        self.credits = Semaphore(2)  # a buffer each: the one the loop holds, the one ahead
        self.ready: queue.SimpleQueue[torch.Tensor | BaseException | None] = queue.SimpleQueue()
        self.holds = False
        self.thread = threading.Thread(target=self._run, args=(source,), daemon=True)
        self.thread.start()

    def _run(self, source: ShmReorganizer) -> None:
        try:
            items = iter(source)
            for i in range(source.n_micro):
                self.credits.acquire()  # a free buffer: at most one ahead of the loop's
                item = next(items)
                buffer = self.buffers[i % 2]
                np.copyto(buffer.numpy(), np.frombuffer(item.buffer, np.uint8))
                item.release()
                self.ready.put(buffer)
        except BaseException as error:  # raised in the loop
            self.ready.put(error)

    def __next__(self) -> Tensors:
        if self.holds:
            self.credits.release()
        item = self.ready.get(timeout=600)
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        self.holds = True
        return field_tensors(item.to(self.device, non_blocking=True), self.layout)

    def close(self) -> None:
        self.credits.release()
        self.thread.join(timeout=60)


class SourceDataset(IterableDataset):
    """The source's micro-batches for a DataLoader: worker k of m prepares micro-batches k, k + m,
    ... (the loader hands them out in order, worker by worker), each copied out of its slot."""

    def __init__(self, source: ShmReorganizer) -> None:
        self.source = source

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for item in self.source.packed(range(worker, self.source.n_micro, workers)):
            flat = torch.from_numpy(np.frombuffer(item.buffer, np.uint8).copy())
            item.release()
            yield flat


class LoaderLoop:
    """``DataLoader(num_workers=2, pin_memory=True, persistent_workers=True)``, one per source:
    its workers start once (``start_loader``) and serve every mini-batch as one epoch; batches
    are moved to the device in the loop."""

    def __init__(self, source: ShmReorganizer, device: str) -> None:
        self.layout, self.device = source.layout, device
        self.batches = iter(start_loader(source))  # a new epoch on the running workers

    def __next__(self) -> Tensors:
        flat = next(self.batches)
        return field_tensors(flat.to(self.device, non_blocking=True), self.layout)

    def close(self) -> None:
        del self.batches  # the workers stay for the next mini-batch


def start_loader(source: ShmReorganizer) -> DataLoader:
    """The source's DataLoader, its workers started (and one micro-batch taken) the first time:
    a training job starts its loader once, not per mini-batch (untimed)."""
    if source.loader is None:
        with warnings.catch_warnings():  # a CPU-only build pins nothing and says so
            warnings.filterwarnings("ignore", message=".*pin_memory.*")
            source.loader = DataLoader(
                SourceDataset(source),
                batch_size=None,
                num_workers=2,
                pin_memory=True,
                persistent_workers=True,
            )
            next(iter(source.loader))
    return source.loader


class IterLoop:
    """The ``MicroBatchIterator`` over the source."""

    def __init__(self, source: ShmReorganizer, device: str, config: MicroBatchIterator.Config):
        self.it = MicroBatchIterator(source, config, device=device)

    def __next__(self) -> Tensors:
        return next(self.it).tensors

    def close(self) -> None:
        self.it.close()


def open_loop(method: str, source: ShmReorganizer, device: str) -> Any:
    """The method's loader over ``source``, prefetching from this moment."""
    if method == "iter":
        return IterLoop(source, device, MicroBatchIterator.Config(depth=2))
    if method == "iter1":
        return IterLoop(source, device, MicroBatchIterator.Config(depth=1))
    if method == "iter_staging":  # CUDA: a pinned staging copy instead of the registered slot
        return IterLoop(source, device, MicroBatchIterator.Config(depth=2, register_host=False))
    if method == "thread":
        return OneAheadThread(source, device)
    if method == "dataloader":
        return LoaderLoop(source, device)
    raise ValueError(f"unknown method {method!r}")


@dataclass(slots=True)
class Run:
    """One mini-batch through a method."""

    waits: list[float]
    """Each micro-batch's wait in next() (wall seconds)."""
    wall: float
    """From the first ask to the end of the last compute."""
    process_cpu: float
    """CPU seconds of this process, all threads (the loop, a prefetch thread; not a DataLoader's
    worker processes), over the same span."""
    handover_cpu: list[float]
    """The loop thread's CPU seconds inside each next()."""
    loop_cpu: float
    """The loop thread's CPU seconds over the span (Linux schedstat; NaN elsewhere)."""
    loop_runqueue: float
    """Seconds the loop thread was ready but waited for a core (other tenants, our own threads)."""

    @property
    def loop_blocked(self) -> float:
        """Seconds the loop thread slept: waiting for data or for the GIL (the data path's doing)."""
        return self.wall - self.loop_cpu - self.loop_runqueue


def run(method: str, source: ShmReorganizer, compute: Compute, device: str, *, warm: bool) -> Run:
    """One mini-batch through the method. ``warm``: one step of compute between creating the
    loader and asking (the loop's lead-in), else the loop asks at once (cold)."""
    loop = open_loop(method, source, device)
    waits, handover_cpu = [], []
    try:
        if warm:
            compute.lead_in(staged(source, device))
        start, cpu, sched = time.perf_counter(), _process_cpu(), _thread_sched()
        for _ in range(source.n_micro):
            asked, asked_cpu = time.perf_counter(), time.thread_time()
            tensors = next(loop)
            handover_cpu.append(time.thread_time() - asked_cpu)
            waits.append(time.perf_counter() - asked)
            compute(tensors)
        wall, cpu = time.perf_counter() - start, _process_cpu() - cpu
        (cpu_end, runqueue_end), (cpu_begin, runqueue_begin) = _thread_sched(), sched
        loop_cpu, loop_runqueue = cpu_end - cpu_begin, runqueue_end - runqueue_begin
    finally:
        loop.close()
    return Run(waits, wall, cpu, handover_cpu, loop_cpu, loop_runqueue)


def _thread_sched() -> tuple[float, float]:
    """This thread's (CPU seconds, seconds ready but waiting for a core), from Linux schedstat."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stat:
            cpu_ns, runqueue_ns, _ = stat.read().split()
    except OSError:
        return math.nan, math.nan
    return int(cpu_ns) / 1e9, int(runqueue_ns) / 1e9


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def staged(source: ShmReorganizer, device: str) -> Tensors:
    """One micro-batch of the source's layout already on the device (the oracle's data)."""
    flat = torch.zeros(source.layout.nbytes, dtype=torch.uint8, device=device)
    return field_tensors(flat, source.layout)


def oracle_wall(source: ShmReorganizer, compute: Compute, device: str) -> float:
    """The same compute over micro-batches already staged on the device: no data path."""
    tensors = staged(source, device)
    start = time.perf_counter()
    for _ in range(source.n_micro):
        compute(tensors)
    return time.perf_counter() - start


def measure(
    device: str,
    n: int,
    tokens: int,
    compute_ms: float,
    prep_ms: float,
    repeats: int,
    methods: Iterable[str],
) -> dict[str, float]:
    """Medians over interleaved repeats of every method, cold and warm, and of the oracle."""
    compute = Compute(compute_ms, device)
    rows: list[dict[str, float]] = []
    for _ in range(repeats):
        source = ShmReorganizer(n, tokens, prep_ms)
        try:
            if "dataloader" in methods:
                start_loader(source)
            pure = oracle_wall(source, compute, device)
            row = {"oracle_ms_per_micro": pure / n * 1e3}
            for method in methods:
                cold = run(method, source, compute, device, warm=False)
                warm = run(method, source, compute, device, warm=True)
                waits = warm.waits
                row |= {
                    f"{method}.cold_first_wait_ms": cold.waits[0] * 1e3,
                    f"{method}.warm_first_wait_ms": waits[0] * 1e3,
                    f"{method}.wait_ms_per_micro": statistics.fmean(waits) * 1e3,
                    f"{method}.steady_wait_us_per_micro": statistics.fmean(waits[1:]) * 1e6,
                    f"{method}.wall_overhead": warm.wall / pure - 1,
                }
                if method != "dataloader":  # its workers' CPU is in other processes
                    row[f"{method}.process_cpu_ms_per_micro"] = warm.process_cpu / n * 1e3
                row[f"{method}.loop_cpu_ms_per_micro"] = warm.loop_cpu / n * 1e3
                row[f"{method}.loop_runqueue_ms_per_micro"] = warm.loop_runqueue / n * 1e3
                row[f"{method}.loop_blocked_ms_per_micro"] = warm.loop_blocked / n * 1e3
            if "thread" in methods:  # paired within the repeat: the same source, load, minute
                row["wall_overhead_minus_thread"] = (
                    row["iter.wall_overhead"] - row["thread.wall_overhead"]
                )
        finally:
            source.close()
        rows.append(row)
        progress(
            f"{device}, X {compute_ms:g} ms, Y {prep_ms:g} ms: repeat {len(rows)}/{repeats} done"
        )
    out = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    for baseline, suffix in (("dataloader", ""), ("thread", ".thread")):
        if baseline in methods:
            iterator, other = out["iter.wait_ms_per_micro"], out[f"{baseline}.wait_ms_per_micro"]
            out[f"exposed_ratio{suffix}"] = iterator / other
            iterator, other = out["iter.cold_first_wait_ms"], out[f"{baseline}.cold_first_wait_ms"]
            out[f"cold_first_wait_ratio{suffix}"] = iterator / other
    return out


@dataclass(frozen=True, slots=True)
class Handover:
    """Time in next() when micro-batches are staged ahead, over micro-batches, in us."""

    median_us: float
    """The iterator's own hand-over cost: the median over consecutive pairs of hand-overs of
    their mean (on CPU the iterator wakes its thread at every other one: ``refill`` 2)."""
    mean_us: float
    """Also carries the moments another tenant kept the prefetch thread off a core a whole step."""
    cpu_us: float
    """Median loop-thread CPU, in pairs as ``median_us``: leaves out waits for a core (moves
    less with the load)."""
    wake_cpu_us: float | None
    """Median loop-thread CPU of one bare wake of a sleeping thread after the same compute
    (``wake_cpu``), interleaved with the iterator's runs; None on CUDA."""


def handover_overhead(
    device: str, n: int, tokens: int, compute_ms: float, repeats: int
) -> Handover:
    """The hand-over's cost (``Handover``); on CPU each repeat also times ``n`` bare wakes."""
    compute = Compute(compute_ms, device)
    waits: list[float] = []
    cpu: list[float] = []
    wakes: list[float] = []
    for _ in range(repeats):
        source = ShmReorganizer(n, tokens, prep_ms=0.0)
        try:
            warm = run("iter", source, compute, device, warm=True)
            waits += _pair_means(warm.waits[1:])
            cpu += _pair_means(warm.handover_cpu[1:])
            if device == "cpu":
                wakes += wake_cpu(compute, staged(source, device), n)
        finally:
            source.close()
    return Handover(
        statistics.median(waits) * 1e6,
        statistics.fmean(waits) * 1e6,
        statistics.median(cpu) * 1e6,
        statistics.median(wakes) * 1e6 if wakes else None,
    )


def _pair_means(values: list[float]) -> list[float]:
    """The mean of each pair of consecutive ``values`` (a last odd one is left out): a per-item
    cost that comes in pairs (one wake per two hand-overs), whose median leaves out the
    outliers a plain mean keeps."""
    return [(a + b) / 2 for a, b in zip(values[::2], values[1::2], strict=False)]


def wake_cpu(compute: Compute, tensors: Tensors, n: int) -> list[float]:
    """The loop thread's CPU seconds in one ``SimpleQueue.put`` that wakes a thread blocked in
    ``get()``, right after one micro-batch of ``compute``, ``n`` times.

    A hand-over to a prefetch thread that is ahead returns a credit to a sleeping thread, so
    this is the least such a hand-over costs on this machine (the iterator's, the one-ahead
    thread's). It moves with the machine, not with knitkit: a cross-CPU wake costs the waker a
    few us on bare metal and tens of us where waking an idle virtual CPU exits to the
    hypervisor.
    """
    credits: queue.SimpleQueue[bool] = queue.SimpleQueue()
    woken: queue.SimpleQueue[None] = queue.SimpleQueue()

    def sleeper() -> None:
        while credits.get():
            woken.put(None)

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    cpu: list[float] = []
    try:
        for _ in range(n):
            compute(tensors)  # the sleeper is blocked in get() again by now
            began = time.thread_time()
            credits.put(True)
            cpu.append(time.thread_time() - began)
            woken.get(timeout=60)
    finally:
        credits.put(False)
        thread.join(timeout=60)
    return cpu


def cuda_bandwidth(quick: bool) -> dict[str, float]:
    """Host-to-device GB/s of a raw pinned copy vs the iterator's copies: from a /dev/shm slot
    read in place (page-locked by registration) and through a pinned staging slot."""
    nbytes, n = (32 if quick else 128) * MiB, 16 if quick else 32
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device.copy_(pinned, non_blocking=True)
    start.record()
    for _ in range(n):
        device.copy_(pinned, non_blocking=True)
    end.record()
    end.synchronize()
    raw = n * nbytes / (start.elapsed_time(end) / 1e3) / 1e9
    layout = MicroBatchLayout.build({"payload": ("uint8", (nbytes,))})
    segment = _shm(nbytes)
    try:
        host = np.frombuffer(_buffer(segment), np.uint8, nbytes)
        host[:] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        figures = {"cuda.raw_h2d_gbps": raw}
        for name, register in (("direct", True), ("staging", False)):
            config = MicroBatchIterator.Config(
                depth=2,
                slot_nbytes=0 if register else nbytes,
                time_h2d=True,
                register_host=register,
            )
            source = (PackedMicroBatch(layout, host, on_release=lambda: None) for _ in range(n))
            wall = time.perf_counter()
            with MicroBatchIterator(source, config, device="cuda") as it:
                for mb in it:
                    mb["payload"][:1].sum()
            torch.cuda.synchronize()
            wall = time.perf_counter() - wall
            copied = n * nbytes / it.stats.h2d_s / 1e9
            figures[f"cuda.{name}.h2d_gbps"] = copied
            figures[f"cuda.{name}.h2d_fraction_of_raw"] = copied / raw
            figures[f"cuda.{name}.delivery_gbps"] = n * nbytes / wall / 1e9
            figures[f"cuda.{name}.delivery_fraction_of_raw"] = n * nbytes / wall / 1e9 / raw
            # 0 when every copy read the registered /dev/shm slot in place (no staging slot)
            figures[f"cuda.{name}.staging_allocations"] = float(it.pool.allocations)
        del host, source, it, mb
    finally:
        gc.collect()
        segment.unlink()
        with contextlib.suppress(BufferError):
            segment.close()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="the same mini-batches, 3 repeats instead of 7"
    )
    parser.add_argument("--gpu", action="store_true", help="also measure on CUDA (fails without)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (compute)")
    parser.add_argument("--json", metavar="PATH", help="write the flat JSON figures here")
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA, but torch.cuda.is_available() is False on this machine")
    # NOTE: one intra-op thread for compute leaves the second core to the helpers.
    torch.set_num_threads(args.threads)
    n, repeats = 64, 3 if args.quick else 7
    settings = [(6.0, 4.0), (6.0, 6.0), (4.0, 6.0)]  # (compute ms, preparation ms); first: headline
    figures: dict[str, float] = {"cpu.threads": float(args.threads), "cpu.n_micro": float(n)}
    figures["cpu.loadavg_1m_at_start"] = os.getloadavg()[0]  # other tenants of the machine
    print(f"CPU: {n} micro-batches of 4096 tokens (0.8 MiB) per mini-batch, median of {repeats}")
    for i, (x_ms, y_ms) in enumerate(settings):
        row = measure("cpu", n, 4096, x_ms, y_ms, repeats, METHODS)
        tag = f"cpu.x{x_ms:g}_y{y_ms:g}"
        figures.update({f"{tag}.{key}": value for key, value in row.items()})
        if i == 0:
            figures.update({f"cpu.{key}": value for key, value in row.items()})
        print_setting(f"X {x_ms:g} ms compute, Y {y_ms:g} ms preparation", row, METHODS)
    handover = handover_overhead("cpu", n, 4096, 6.0, repeats)
    assert handover.wake_cpu_us is not None
    figures["cpu.overhead_us_per_micro"] = handover.median_us
    figures["cpu.overhead_mean_us_per_micro"] = handover.mean_us
    figures["cpu.overhead_cpu_us_per_micro"] = handover.cpu_us
    figures["cpu.wake_cpu_us"] = handover.wake_cpu_us
    figures["cpu.overhead_cpu_minus_wake_us_per_micro"] = handover.cpu_us - handover.wake_cpu_us
    print(
        f"hand-over overhead per micro-batch: median {handover.median_us:.1f} us, mean"
        f" {handover.mean_us:.1f} us (loop thread CPU {handover.cpu_us:.1f} us, of which one wake"
        f" of a sleeping thread costs {handover.wake_cpu_us:.1f} us on this machine)"
    )
    if args.gpu:
        figures.update(cuda_bandwidth(args.quick))
        methods = (*METHODS, "iter_staging")
        cuda = measure("cuda", n, 16384, 8.0, 4.0, repeats, methods)
        figures.update({f"cuda.{key}": value for key, value in cuda.items()})
        print_setting("CUDA: 16384 tokens (3.1 MiB), X 8 ms, Y 4 ms", cuda, methods)
        on_cuda = handover_overhead("cuda", n, 16384, 8.0, repeats)
        figures["cuda.overhead_us_per_micro"] = on_cuda.median_us
        figures["cuda.overhead_mean_us_per_micro"] = on_cuda.mean_us
        figures["cuda.overhead_cpu_us_per_micro"] = on_cuda.cpu_us
        print(
            f"CUDA H2D: raw {figures['cuda.raw_h2d_gbps']:.1f} GB/s; from the registered slot"
            f" {figures['cuda.direct.h2d_gbps']:.1f} GB/s"
            f" ({figures['cuda.direct.h2d_fraction_of_raw']:.2f}), through a staging slot"
            f" {figures['cuda.staging.h2d_gbps']:.1f} GB/s"
            f" ({figures['cuda.staging.h2d_fraction_of_raw']:.2f}); hand-over"
            f" {on_cuda.median_us:.1f} us"
        )
    figures["cpu.loadavg_1m_at_end"] = os.getloadavg()[0]
    print(
        f"load average (1 min) at start / end: {figures['cpu.loadavg_1m_at_start']:.1f} /"
        f" {figures['cpu.loadavg_1m_at_end']:.1f} on {os.cpu_count()} CPUs"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1, sort_keys=True)
    return 0


def print_setting(title: str, row: Mapping[str, float], methods: Iterable[str]) -> None:
    print(f"{title}; oracle (data in memory) {row['oracle_ms_per_micro']:.2f} ms per micro-batch")
    print(
        f"{'method':<14}{'cold first ms':>14}{'warm first ms':>14}{'steady wait us':>16}"
        f"{'wall overhead':>15}{'process CPU ms':>16}{'loop cpu/runq/blocked ms':>26}"
    )
    for method in methods:
        cpu = row.get(f"{method}.process_cpu_ms_per_micro")
        print(
            f"{method:<14}{row[f'{method}.cold_first_wait_ms']:>14.2f}"
            f"{row[f'{method}.warm_first_wait_ms']:>14.2f}"
            f"{row[f'{method}.steady_wait_us_per_micro']:>16.1f}"
            f"{row[f'{method}.wall_overhead']:>15.1%}"
            + (f"{cpu:>16.2f}" if cpu is not None else f"{'-':>16}")
            + f"{row[f'{method}.loop_cpu_ms_per_micro']:>10.2f}"
            + f"{row[f'{method}.loop_runqueue_ms_per_micro']:>8.2f}"
            + f"{row[f'{method}.loop_blocked_ms_per_micro']:>8.2f}"
        )
    print(
        f"iterator wait / DataLoader wait {row['exposed_ratio']:.3f} (cold first micro-batch"
        f" {row['cold_first_wait_ratio']:.3f}); / one-ahead thread {row['exposed_ratio.thread']:.3f}"
        f" (cold first {row['cold_first_wait_ratio.thread']:.3f}); iterator - thread wall overhead,"
        f" paired per repeat: {row['wall_overhead_minus_thread']:+.1%}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
