"""Micro-batch prefetch: exposed data wait of eager fetching vs the MicroBatchIterator (paper Fig. 11b).

Each micro-batch is prepared by a stand-in reorganizer that packs slices of trajectories out
of a /dev/shm trajectory store into a /dev/shm slot (real copies, topped up with a sleep to
Y ms, the rest of a reorganizer's read latency). The training step is X ms of real matmuls.

- eager: the mini-batch is materialized (every micro-batch prepared and copied out of its
  slot) before computing; the whole preparation is exposed.
- iter: MicroBatchIterator prefetches micro-batch i+1.. while micro-batch i computes.

Lead-in: a training loop does work before it asks for a step's first micro-batch (the
previous step's optimizer update and logging). Both methods get the same lead-in, one step of
compute (X ms), before their clock starts: the iterator is created before it and starts
prefetching at construction, so its first micro-batch is staged meanwhile; eager fetches on
demand and cannot use it. Every micro-batch's wait still counts, the first included; the
cold start (no lead-in: the loop asks right after creating the iterator, so the first
micro-batch's preparation is exposed and bounds the ratio at about 1 / n) is reported too.

CPU keys: ``cpu.exposed_ratio`` (iterator wait / eager wait over the same micro-batches, with
the lead-in; ``cpu.iter_first_wait_ms`` is the first micro-batch's wait), ``cpu.cold.*`` (the
same without the lead-in), ``cpu.overhead_us_per_micro`` (median time inside next() when
micro-batches are staged ahead: the iterator's own hand-over cost; the mean, which also carries
scheduling stalls caused by other tenants, is ``cpu.overhead_mean_us_per_micro``).
``--gpu`` adds the CUDA form: ``cuda.exposed_ratio`` (wall time beyond pure compute, iter /
eager; device copies straight from the page-locked /dev/shm slots), ``cuda.staging.*`` (the
same with ``register_host=False``: each slot copied into a pinned staging slot first),
``cuda.cold.*``, ``cuda.overhead_us_per_micro``, ``cuda.stage_us_per_micro`` (the prefetch
thread's time per micro-batch, staging copy included where there is one), and host-to-device
GB/s of a raw pinned copy vs the iterator's copies (``cuda.{direct,staging}.h2d_gbps``).

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
        store_bytes = np.frombuffer(_buffer(self.store), np.uint8)
        store_bytes[:] = np.random.default_rng(0).integers(0, 100, store_bytes.size, np.uint8)
        del store_bytes
        self.free = Semaphore(self.slots)

    def __iter__(self) -> Iterator[PackedMicroBatch]:
        store = self.store_layout.numpy_views(_buffer(self.store))
        quarter = self.tokens // 4
        for i in range(self.n_micro):
            start = time.perf_counter()
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


def _buffer(segment: shared_memory.SharedMemory) -> memoryview:
    assert segment.buf is not None, f"shared memory {segment.name} is closed"
    return segment.buf


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


def lead_in(compute, device: str) -> None:
    """The loop's work before it asks for its first micro-batch, the same for every method: one
    training step's compute, standing for the previous step's optimizer update and logging."""
    compute(torch.zeros(8, dtype=torch.int32, device=device)).item()


def eager_run(source: ShmReorganizer, compute, device: str) -> tuple[float, float]:
    """Materialize the whole mini-batch, then compute: returns (wait_s, wall_s).

    The host buffers are allocated and touched before the clock starts, so eager pays for
    preparation and copies only, not for page faults. The lead-in runs first; eager fetches on
    demand, so it cannot use it.
    """
    buffers = [torch.zeros(source.layout.nbytes, dtype=torch.uint8) for _ in range(source.n_micro)]
    lead_in(compute, device)
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


def iter_run(source, compute, device: str, config: MicroBatchIterator.Config, *, lead: bool = True):
    """Compute while the iterator prefetches: returns (stats, wall_s, per-micro-batch waits).

    The iterator is created before the lead-in (it starts prefetching at construction, so the
    first micro-batch is staged meanwhile); ``lead=False`` is a cold start: the loop asks for
    the first micro-batch right after creating the iterator.
    """
    waits = []
    with MicroBatchIterator(source, config, device=device) as it:
        if lead:
            lead_in(compute, device)
        start = time.perf_counter()
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


def measure(
    device: str,
    n: int,
    tokens: int,
    compute_ms: float,
    prep_ms: float,
    repeats: int,
    *,
    cold: bool = False,
    staging: bool = False,
) -> dict[str, float]:
    """Median over repeats of eager vs iterator waits for one (compute, preparation) setting.

    ``cold`` adds ``cold.*``: the iterator without the lead-in (the loop asks for the first
    micro-batch right after creating it). ``staging`` (CUDA) adds ``staging.*``: the iterator
    with ``register_host=False``, i.e. each published slot copied into a pinned staging slot
    before the device copy (the path before in-place registration).
    """
    compute = calibrated_compute(compute_ms, device)
    rows = []
    for _ in range(repeats):
        source = ShmReorganizer(n, tokens, prep_ms)
        try:
            pure = compute_only(n, compute, device)
            eager_wait, eager_wall = eager_run(source, compute, device)
            row = {
                "eager_wait_ms_per_micro": eager_wait / n * 1e3,
                "compute_ms_per_micro": pure / n * 1e3,
            }
            variants = {"": (MicroBatchIterator.Config(depth=2), True)}
            if cold:
                variants["cold."] = (MicroBatchIterator.Config(depth=2), False)
            if staging:
                variants["staging."] = (
                    MicroBatchIterator.Config(depth=2, register_host=False),
                    True,
                )
            for prefix, (config, lead) in variants.items():
                stats, iter_wall, _ = iter_run(source, compute, device, config, lead=lead)
                row |= {
                    f"{prefix}exposed_ratio": stats.wait_s / eager_wait,
                    f"{prefix}steady_exposed_ratio": stats.steady_wait_s
                    / (eager_wait * (n - 1) / n),
                    f"{prefix}iter_wait_ms_per_micro": stats.wait_s / n * 1e3,
                    # Without the lead-in, the first micro-batch has no compute to hide behind:
                    # its wait bounds cold.exposed_ratio from below at about 1 / n.
                    f"{prefix}iter_first_wait_ms": stats.first_wait_s * 1e3,
                    f"{prefix}wall_exposed_ratio": (iter_wall - pure) / (eager_wall - pure),
                    f"{prefix}stage_us_per_micro": stats.stage_s / n * 1e6,
                }
        finally:
            source.close()
        rows.append(row)
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
        row = measure("cpu", n, 4096, x_ms, y_ms, repeats, cold=i == 0)
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
    print(
        f"cold start (no lead-in): ratio {figures['cpu.cold.exposed_ratio']:.3f}, first wait"
        f" {figures['cpu.cold.iter_first_wait_ms']:.2f} ms (with lead-in"
        f" {figures['cpu.iter_first_wait_ms']:.3f} ms)"
    )
    median, mean = handover_overhead_us("cpu", n, 4096, 6.0, repeats)
    figures["cpu.overhead_us_per_micro"], figures["cpu.overhead_mean_us_per_micro"] = median, mean
    print(f"hand-over overhead per micro-batch: median {median:.1f} us, mean {mean:.1f} us")
    if args.gpu:
        figures.update(cuda_bandwidth(args.quick))
        cuda = measure("cuda", n, 16384, 8.0, 4.0, repeats, cold=True, staging=True)
        figures.update({f"cuda.{key}": value for key, value in cuda.items()})
        # NOTE: on CUDA the compute stream may also wait on a copy's event, which no host-side
        # wait shows: the headline is the wall time beyond pure compute, iter / eager.
        for prefix in ("", "cold.", "staging."):
            figures[f"cuda.{prefix}wait_exposed_ratio"] = cuda[f"{prefix}exposed_ratio"]
            figures[f"cuda.{prefix}exposed_ratio"] = cuda[f"{prefix}wall_exposed_ratio"]
        median, mean = handover_overhead_us("cuda", n, 16384, 8.0, repeats)
        figures["cuda.overhead_us_per_micro"], figures["cuda.overhead_mean_us_per_micro"] = (
            median,
            mean,
        )
        print(
            f"CUDA H2D: raw {figures['cuda.raw_h2d_gbps']:.1f} GB/s; from the registered slot"
            f" {figures['cuda.direct.h2d_gbps']:.1f} GB/s"
            f" ({figures['cuda.direct.h2d_fraction_of_raw']:.2f}), through a staging slot"
            f" {figures['cuda.staging.h2d_gbps']:.1f} GB/s"
            f" ({figures['cuda.staging.h2d_fraction_of_raw']:.2f}); delivery"
            f" {figures['cuda.direct.delivery_gbps']:.1f} vs"
            f" {figures['cuda.staging.delivery_gbps']:.1f} GB/s"
        )
        print(
            f"CUDA: {n} micro-batches of 16384 tokens (3.1 MiB), X 8 ms (real"
            f" {cuda['compute_ms_per_micro']:.2f}), Y 4 ms: eager wait"
            f" {cuda['eager_wait_ms_per_micro']:.2f} ms, iter wait"
            f" {cuda['iter_wait_ms_per_micro']:.3f} ms per micro-batch; exposed ratio (wall)"
            f" {figures['cuda.exposed_ratio']:.3f} (staging copy"
            f" {figures['cuda.staging.exposed_ratio']:.3f}, cold start"
            f" {figures['cuda.cold.exposed_ratio']:.3f}); thread stage time"
            f" {cuda['stage_us_per_micro']:.0f} us (staging copy"
            f" {cuda['staging.stage_us_per_micro']:.0f} us); hand-over"
            f" {figures['cuda.overhead_us_per_micro']:.1f} us"
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
