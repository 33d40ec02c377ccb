"""Micro-batch prefetch: exposed data wait of eager fetching vs the MicroBatchIterator (paper Fig. 11b).

Each micro-batch is prepared by a stand-in reorganizer that packs slices of trajectories out
of a /dev/shm trajectory store into a /dev/shm slot (real copies, topped up with a sleep to
Y ms, the rest of a reorganizer's read latency). The training step is X ms of real matmuls.

- eager: the mini-batch is materialized (every micro-batch prepared and copied out of its
  slot) before computing; the whole preparation is exposed.
- iter: MicroBatchIterator prefetches micro-batch i+1.. while micro-batch i computes.

CPU keys: ``cpu.exposed_ratio`` (iterator wait / eager wait over the same micro-batches, the
first micro-batch's unavoidable wait included, so about 1 / n at best; ``cpu.iter_first_wait_ms``
is that wait), ``cpu.overhead_us_per_micro`` (median time
inside next() when micro-batches are staged ahead: the iterator's own hand-over cost; the mean,
which also carries scheduling stalls caused by other tenants, is ``cpu.overhead_mean_us_per_micro``).
``--gpu`` adds ``gpu.h2d_fraction_of_raw`` (host-to-device bandwidth of the pool's copies vs a
raw pinned copy) and ``gpu.exposed_ratio`` (wall time beyond pure compute, iter / eager).

    python benchmarks/prefetch.py [--quick] [--gpu] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from threading import Semaphore

import numpy as np
import torch

from knitkit.microbatch_iter import MicroBatchIterator, PackedMicroBatch, field_tensors
from knitkit.types import MicroBatchLayout

MiB = 1 << 20
TRAJECTORIES = 16


class ShmReorganizer:
    """Packs micro-batches of ``tokens`` tokens from 4 trajectories of a /dev/shm store into slots."""

    def __init__(self, n_micro: int, tokens: int, prep_ms: float, *, layers: int = 24) -> None:
        self.n_micro, self.tokens, self.prep_s = n_micro, tokens, prep_ms / 1e3
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
        store_bytes = np.frombuffer(self.store.buf, np.uint8)
        store_bytes[:] = np.random.default_rng(0).integers(0, 100, store_bytes.size, np.uint8)
        del store_bytes
        self.free = Semaphore(self.slots)

    def __iter__(self) -> Iterator[PackedMicroBatch]:
        store = self.store_layout.numpy_views(self.store.buf)
        quarter = self.tokens // 4
        for i in range(self.n_micro):
            start = time.perf_counter()
            self.free.acquire()
            offset = (i % self.slots) * self.layout.nbytes
            slot = self.ring.buf[offset : offset + self.layout.nbytes]
            packed = self.layout.numpy_views(slot)
            for part in range(4):  # 4 trajectory slices, as the planner would assign them
                traj, begin = (7 * i + part) % TRAJECTORIES, (i * 131) % (self.store_len - quarter)
                for name, dst in packed.items():
                    src = store[name][traj, begin : begin + quarter]
                    np.copyto(dst[part * quarter : (part + 1) * quarter], src)
            del packed
            remaining = self.prep_s - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)
            yield PackedMicroBatch(self.layout, slot, on_release=self.free.release)
        del store

    def close(self) -> None:
        gc.collect()  # drop finished generators' views so the mappings can close
        for segment in (self.store, self.ring):
            segment.unlink()
            with contextlib.suppress(BufferError):
                segment.close()


def _shm(nbytes: int) -> shared_memory.SharedMemory:
    return shared_memory.SharedMemory(f"knitkit-bench-{uuid.uuid4().hex[:12]}", True, nbytes)


def calibrated_compute(ms: float, device: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A training step of ``ms`` of real matmuls that also reads the micro-batch's tokens.

    On CPU the step runs 128x128 matmuls until ``ms`` of wall time has passed, so its length
    holds on a loaded machine (the amount of work then varies). On GPU it runs a number of
    4096x4096 bf16 matmuls calibrated once with events.
    """
    size = 128 if device == "cpu" else 4096
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    a = torch.randn(size, size, device=device, dtype=dtype) / size**0.5

    def timed_step(tokens: torch.Tensor) -> torch.Tensor:
        deadline = time.perf_counter() + ms / 1e3
        x = a
        while time.perf_counter() < deadline:
            x = torch.tanh(a @ x)
        return x[0, 0] + tokens[:8].sum()

    if device == "cpu":
        return timed_step

    def step(tokens: torch.Tensor, reps: int) -> torch.Tensor:
        x = a
        for _ in range(reps):
            x = torch.tanh(a @ x)
        return x[0, 0] + tokens[:8].sum()

    probe = torch.zeros(8, dtype=torch.int32, device=device)
    step(probe, 3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step(probe, 50)
    end.record()
    end.synchronize()
    reps = max(1, round(ms / (start.elapsed_time(end) / 50)))
    return lambda tokens: step(tokens, reps)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def eager_run(source: ShmReorganizer, compute, device: str) -> tuple[float, float]:
    """Materialize the whole mini-batch, then compute: returns (wait_s, wall_s).

    The host buffers are allocated and touched before the clock starts, so eager pays for
    preparation and copies only, not for page faults.
    """
    buffers = [torch.zeros(source.layout.nbytes, dtype=torch.uint8) for _ in range(source.n_micro)]
    start = time.perf_counter()
    staged = []
    for item, flat in zip(source, buffers, strict=True):
        np.copyto(flat.numpy(), np.frombuffer(item.buffer, np.uint8))
        item.release()
        staged.append(flat.to(device))
    _sync(device)
    wait = time.perf_counter() - start
    for flat in staged:
        compute(field_tensors(flat, source.layout)["tokens"]).item()
    return wait, time.perf_counter() - start


def iter_run(source, compute, device: str, config: MicroBatchIterator.Config):
    """Compute while the iterator prefetches: returns (stats, wall_s, per-micro-batch waits)."""
    waits = []
    start = time.perf_counter()
    with MicroBatchIterator(source, config, device=device) as it:
        for mb in it:
            waits.append(mb.stats.wait_s)
            compute(mb["tokens"]).item()  # a loss.item() per step
    return it.stats, time.perf_counter() - start, waits


def compute_only(n: int, compute, device: str) -> float:
    tokens = torch.zeros(8, dtype=torch.int32, device=device)
    start = time.perf_counter()
    for _ in range(n):
        compute(tokens).item()
    return time.perf_counter() - start


def measure(device: str, n: int, tokens: int, compute_ms: float, prep_ms: float, repeats: int):
    """Median over repeats of eager vs iterator waits for one (compute, preparation) setting."""
    compute = calibrated_compute(compute_ms, device)
    rows = []
    for _ in range(repeats):
        source = ShmReorganizer(n, tokens, prep_ms)
        try:
            pure = compute_only(n, compute, device)
            eager_wait, eager_wall = eager_run(source, compute, device)
            config = MicroBatchIterator.Config(depth=2)
            stats, iter_wall, _ = iter_run(source, compute, device, config)
        finally:
            source.close()
        rows.append(
            {
                "exposed_ratio": stats.wait_s / eager_wait,
                "steady_exposed_ratio": stats.steady_wait_s / (eager_wait * (n - 1) / n),
                "eager_wait_ms_per_micro": eager_wait / n * 1e3,
                "iter_wait_ms_per_micro": stats.wait_s / n * 1e3,
                # The first micro-batch has no compute to hide behind: its wait (thread start-up
                # included) bounds exposed_ratio from below at about 1 / n.
                "iter_first_wait_ms": stats.first_wait_s * 1e3,
                "compute_ms_per_micro": pure / n * 1e3,
                "wall_exposed_ratio": (iter_wall - pure) / (eager_wall - pure),
                "stage_us_per_micro": stats.stage_s / n * 1e6,
            }
        )
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def handover_overhead_us(device: str, n: int, tokens: int, compute_ms: float, repeats: int):
    """Time in next() when micro-batches are staged ahead: (median, mean) over micro-batches.

    The median is the iterator's own hand-over cost; the mean also carries the moments another
    tenant of the machine kept the prefetch thread off the CPU for a whole step.
    """
    compute = calibrated_compute(compute_ms, device)
    waits: list[float] = []
    for _ in range(repeats):
        source = ShmReorganizer(n, tokens, prep_ms=0.0)
        try:
            waits += iter_run(source, compute, device, MicroBatchIterator.Config(depth=2))[2][1:]
        finally:
            source.close()
    return statistics.median(waits) * 1e6, statistics.fmean(waits) * 1e6


def gpu_bandwidth(quick: bool) -> dict[str, float]:
    """Host-to-device GB/s of a raw pinned copy vs the pool's copies (and end-to-end delivery)."""
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
    host = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    config = MicroBatchIterator.Config(depth=2, slot_nbytes=nbytes, time_h2d=True)
    wall = time.perf_counter()
    with MicroBatchIterator(((layout, host) for _ in range(n)), config, device="cuda") as it:
        for mb in it:
            mb["payload"][:1].sum()
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    pool = n * nbytes / it.stats.h2d_s / 1e9
    return {
        "gpu.raw_h2d_gbps": raw,
        "gpu.pool_h2d_gbps": pool,
        "gpu.h2d_fraction_of_raw": pool / raw,
        "gpu.delivery_gbps": n * nbytes / wall / 1e9,
        "gpu.delivery_fraction_of_raw": n * nbytes / wall / 1e9 / raw,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer micro-batches (< 1 min)")
    parser.add_argument("--gpu", action="store_true", help="also measure on CUDA (fails without)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (compute)")
    parser.add_argument("--json", metavar="PATH", help="write the flat JSON figures here")
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA, but torch.cuda.is_available() is False on this machine")
    # NOTE: one intra-op thread for compute leaves the second core to the prefetch thread.
    torch.set_num_threads(args.threads)
    n, repeats = (64, 3) if args.quick else (128, 5)
    settings = [
        (6.0, 4.0),
        (6.0, 6.0),
        (4.0, 6.0),
    ]  # (compute ms, preparation ms); first = headline
    figures: dict[str, float] = {"cpu.threads": float(args.threads), "cpu.n_micro": float(n)}
    figures["cpu.loadavg_1m_at_start"] = os.getloadavg()[0]  # other tenants of the machine
    print(f"CPU: {n} micro-batches of 4096 tokens (0.8 MiB), median of {repeats} runs")
    header = ("X ms", "X real", "Y ms", "eager wait", "iter wait", "ratio", "steady", "wall")
    print("{:>6} {:>7} {:>5} {:>11} {:>10} {:>7} {:>7} {:>7}".format(*header))
    for i, (x_ms, y_ms) in enumerate(settings):
        row = measure("cpu", n, 4096, x_ms, y_ms, repeats)
        tag = f"cpu.x{x_ms:g}_y{y_ms:g}"
        figures.update({f"{tag}.{key}": value for key, value in row.items()})
        if i == 0:
            figures.update({f"cpu.{key}": value for key, value in row.items()})
        print(
            f"{x_ms:6.1f} {row['compute_ms_per_micro']:7.2f} {y_ms:5.1f}"
            f" {row['eager_wait_ms_per_micro']:9.2f}ms {row['iter_wait_ms_per_micro']:8.3f}ms"
            f" {row['exposed_ratio']:7.3f} {row['steady_exposed_ratio']:7.3f}"
            f" {row['wall_exposed_ratio']:7.3f}"
        )
    print(
        "ratio = iterator wait / eager wait (first micro-batch included); steady = without the"
        " first; wall = (wall - pure compute), iterator / eager"
    )
    median, mean = handover_overhead_us("cpu", n, 4096, 6.0, repeats)
    figures["cpu.overhead_us_per_micro"], figures["cpu.overhead_mean_us_per_micro"] = median, mean
    print(f"hand-over overhead per micro-batch: median {median:.1f} us, mean {mean:.1f} us")
    if args.gpu:
        figures.update(gpu_bandwidth(args.quick))
        gpu = measure("cuda", n, 16384, 8.0, 4.0, repeats)
        figures.update({f"gpu.{key}": value for key, value in gpu.items()})
        # NOTE: on GPU the compute stream may also wait on a copy's event, which no host-side
        # wait shows: the headline is the wall time beyond pure compute, iter / eager.
        figures["gpu.wait_exposed_ratio"] = gpu["exposed_ratio"]
        figures["gpu.exposed_ratio"] = gpu["wall_exposed_ratio"]
        median, mean = handover_overhead_us("cuda", n, 16384, 8.0, repeats)
        figures["gpu.overhead_us_per_micro"], figures["gpu.overhead_mean_us_per_micro"] = (
            median,
            mean,
        )
        print(
            f"GPU H2D: raw {figures['gpu.raw_h2d_gbps']:.1f} GB/s, pool"
            f" {figures['gpu.pool_h2d_gbps']:.1f} GB/s ({figures['gpu.h2d_fraction_of_raw']:.2f}),"
            f" delivery {figures['gpu.delivery_gbps']:.1f} GB/s"
        )
        print(
            f"GPU: {n} micro-batches of 16384 tokens (3.1 MiB), X 8 ms (real"
            f" {gpu['compute_ms_per_micro']:.2f}), Y 4 ms: eager wait"
            f" {gpu['eager_wait_ms_per_micro']:.2f} ms, iter wait {gpu['iter_wait_ms_per_micro']:.3f}"
            f" ms per micro-batch; exposed ratio (wall) {figures['gpu.exposed_ratio']:.3f},"
            f" (waits) {figures['gpu.wait_exposed_ratio']:.3f}; hand-over"
            f" {figures['gpu.overhead_us_per_micro']:.1f} us"
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


if __name__ == "__main__":
    raise SystemExit(main())
