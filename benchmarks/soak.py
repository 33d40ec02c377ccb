"""Soak: resource growth over many write/plan/deliver/consume/release cycles (issue 9's done-when).

Each cycle writes a mini-batch of trajectories into a ``TrajectoryStore`` (2 to 7 of them on
DP4, so some DP ranks are idle in some cycles), plans and registers it, submits every (DP, CP)
consumer's plan to its long-lived ``ReorganizerProcess``, consumes every micro-batch from the
rings in this process, and reports each consumer done, which frees the units. Reorganizers,
rings, consumers and the backend live for the whole run, as in an RL job.

After a warm-up the growth of, over this process and the reorganizer processes: resident memory
(``rss_growth_mb``), open file descriptors (``fd_growth``), bytes of this run's /dev/shm
segments (``shm_growth_bytes``), the shared-memory unit journal (``journal_bytes`` at the end,
``journal_growth_bytes``), and the shard directory (``disk_growth_bytes``). Healthy: every
growth 0 except RSS, which stays under a few MB (allocator noise).

    python benchmarks/soak.py [--quick] [--cycles N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from progress import Progress

from knitkit.storage import (
    MicroBatchConsumer,
    PlannerConfig,
    ReorganizerProcess,
    RingSpec,
    SafetensorsBackend,
    SharedMemoryBackend,
    Topology,
    Trajectory,
    TrajectoryStore,
    UnitBackend,
    plan_minibatch,
)

progress = Progress("soak")

TOPOLOGY = Topology(dp=4, cp=1, tp=1)
CONFIG = PlannerConfig(
    token_fields=("tokens", "logprobs", "routing"),
    scalar_fields=("reward",),
    max_tokens_per_micro_batch=512,
    min_micro_batches=2,
)
SLOT_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Sample:
    """Resources in use at one moment (this process plus its reorganizer processes)."""

    rss_bytes: int
    fds: int
    shm_bytes: int
    journal_bytes: int
    disk_bytes: int


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _dir_bytes(directory: str, prefixes: tuple[str, ...] = ()) -> int:
    total = 0
    for name in os.listdir(directory):
        if prefixes and not name.startswith(prefixes):
            continue
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(os.path.join(directory, name)).st_blocks * 512
    return total


def _trajectory(cycle: int, index: int, rng: np.random.Generator) -> Trajectory:
    n = int(rng.integers(64, 900))
    tokens = rng.integers(0, 50_000, n, dtype=np.int32)
    return Trajectory(
        f"c{cycle}-t{index}",
        f"c{cycle}-s{index // 2}",
        {
            "tokens": tokens,
            "logprobs": rng.standard_normal(n).astype(np.float32),
            "routing": rng.integers(0, 64, (n, 4, 2), dtype=np.uint8),
        },
        {"reward": np.float32(index)},
    )


class Soak:
    """One backend's long-lived store, reorganizer processes and consumers."""

    def __init__(self, kind: str, workdir: str) -> None:
        self.kind = kind
        self.shard_dir = os.path.join(workdir, "shards")
        self.backend: UnitBackend = (
            SharedMemoryBackend(slab_bytes=8 << 20)
            if kind == "shm"
            else SafetensorsBackend(self.shard_dir, shard_bytes=4 << 20)
        )
        self.store = TrajectoryStore(self.backend)
        self.reorganizers: list[ReorganizerProcess] = []
        self.consumers: list[MicroBatchConsumer] = []
        for _ in range(TOPOLOGY.dp * TOPOLOGY.cp):
            spec = RingSpec.new(num_slots=4, slot_bytes=SLOT_BYTES, num_consumers=1)
            self.reorganizers.append(ReorganizerProcess(self.backend, spec))
            self.consumers.append(MicroBatchConsumer(spec, 0, liveness_timeout_s=120.0))
        self.rng = np.random.default_rng(0)
        self.micro_batches = 0

    def cycle(self, index: int) -> None:
        trajectories = [
            _trajectory(index, i, self.rng) for i in range(int(self.rng.integers(2, 8)))
        ]
        metas = [self.store.write(t) for t in trajectories]
        if isinstance(self.backend, SafetensorsBackend):
            self.backend.flush()
        plan = plan_minibatch(metas, TOPOLOGY, CONFIG, minibatch_id=f"mb{index}")
        plan = self.store.register(plan)
        for reorganizer, consumer_plan in zip(self.reorganizers, plan.consumers, strict=True):
            reorganizer.submit(plan.minibatch_id, consumer_plan)
        for consumer, consumer_plan in zip(self.consumers, plan.consumers, strict=True):
            for _ in consumer_plan.micro_batches:
                batch = consumer.next_micro_batch(timeout_s=120.0)
                if batch.layout.extra["minibatch_id"] != plan.minibatch_id:
                    raise RuntimeError(f"cycle {index}: got {batch.layout.extra}, out of order")
                batch.release()
                self.micro_batches += 1
            self.store.consumed(plan.minibatch_id, consumer_plan.name)
        if self.store.index.trajectory_ids():
            raise RuntimeError(f"cycle {index}: trajectories left after release")

    def sample(self) -> Sample:
        pids = [os.getpid(), *(r.pid for r in self.reorganizers if r.pid is not None)]
        mine = (f"knitkit-{os.getpid()}-", f"knitkit_{os.getpid()}_")
        shm = _dir_bytes("/dev/shm", mine)
        return Sample(
            rss_bytes=sum(_rss_bytes(pid) for pid in pids),
            fds=sum(len(os.listdir(f"/proc/{pid}/fd")) for pid in pids),
            shm_bytes=shm,
            journal_bytes=(
                self.backend.journal_bytes if isinstance(self.backend, SharedMemoryBackend) else 0
            ),
            disk_bytes=_dir_bytes(self.shard_dir) if os.path.isdir(self.shard_dir) else 0,
        )

    def close(self) -> None:
        for consumer in self.consumers:
            consumer.close()
        for reorganizer in self.reorganizers:
            reorganizer.close()
        self.store.close()


@contextlib.contextmanager
def _soak(kind: str) -> Iterator[Soak]:
    with tempfile.TemporaryDirectory(prefix="knitkit-soak-") as workdir:
        soak = Soak(kind, workdir)
        try:
            yield soak
        finally:
            soak.close()


def run_backend(kind: str, cycles: int, warmup: int) -> dict[str, float]:
    with _soak(kind) as soak:
        for index in range(warmup):
            soak.cycle(index)
        before = soak.sample()
        start = time.perf_counter()  # the measured cycles only: start-up stays out
        for index in range(warmup, warmup + cycles):
            soak.cycle(index)
        elapsed = time.perf_counter() - start
        after = soak.sample()
    prefix = f"soak.{kind}"
    return {
        f"{prefix}.cycles": cycles,
        f"{prefix}.warmup_cycles": warmup,
        f"{prefix}.micro_batches": soak.micro_batches,
        f"{prefix}.rss_growth_mb": round((after.rss_bytes - before.rss_bytes) / 2**20, 2),
        f"{prefix}.fd_growth": after.fds - before.fds,
        f"{prefix}.shm_growth_bytes": after.shm_bytes - before.shm_bytes,
        f"{prefix}.journal_bytes": after.journal_bytes,
        f"{prefix}.journal_growth_bytes": after.journal_bytes - before.journal_bytes,
        f"{prefix}.disk_growth_bytes": after.disk_bytes - before.disk_bytes,
        f"{prefix}.ms_per_cycle": round(1e3 * elapsed / cycles, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 cycles per backend")
    parser.add_argument("--cycles", type=int, default=None, help="measured cycles per backend")
    parser.add_argument("--warmup", type=int, default=None, help="cycles before the baseline")
    parser.add_argument("--backends", default="shm,disk")
    parser.add_argument("--json", default=None, help="write the figures as one flat JSON object")
    args = parser.parse_args()
    cycles = args.cycles or (100 if args.quick else 1000)
    warmup = args.warmup if args.warmup is not None else max(20, cycles // 10)
    results: dict[str, float] = {"loadavg_1m_at_start": os.getloadavg()[0]}
    for kind in args.backends.split(","):
        results.update(run_backend(kind, cycles, warmup))
        progress(f"{kind}: {cycles} cycles done")
    results["loadavg_1m_at_end"] = os.getloadavg()[0]
    width = max(len(k) for k in results)
    print(f"{'figure':<{width}}  value")
    for key, value in results.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
