"""Transfer benchmark: knitkit vs sample-level vs TransferQueue delivery to real consumer processes.

A DP2 x CP2 x TP2 backbone (8 consumer processes) plus a DP2 vision encoder train several
mini-batches of GRPO trajectories with MoE routing fields ([seq, layers, top-k]) and images.
Each consumer "computes" every backbone micro-batch for ``compute_s`` (a sleep: GPU time costs
no host CPU) and measures how long it waits for data:

- knitkit: one reorganizer process per (DP, CP) group and per encoder rank reads exactly its
  ranges from the shared-memory store and publishes packed micro-batches in consumption order
  into node-local shared memory; consumers take zero-copy views.
- sample_level: every rank reads its DP share's whole trajectories from the same store before
  the step (images on TP0/CP0, once per referencing trajectory), then packs locally.
- transferqueue: the same, through the real TransferQueue (one row per trajectory, KV API).

Keys: ``<method>.bytes_read_ratio`` (bytes read / bytes the step consumes, images counted once),
``<method>.exposed_s_per_step`` (per step the slowest rank's wait, averaged over steps),
``sliced_read.<backend>.fraction_of_ceiling`` (sliced-read throughput / a plain memcpy (memory,
shm) or page-cache ``preadv`` (disk) of the same bytes), ``planner_ms`` (DP32 x CP2 x TP4, 4096
trajectories, the storage planner).

    python benchmarks/transfer.py [--quick] [--json PATH] [--skip-tq]
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from knitkit.storage import (
    EncoderTopology,
    MiniBatchPlan,
    PlannerConfig,
    SharedMemoryBackend,
    Topology,
    TrajectoryStore,
    pack_layout,
    plan_minibatch,
)
from knitkit.storage.baselines.planner_timing import planner_ms
from knitkit.storage.baselines.sample_level import (
    LocalTrajectories,
    RankPosition,
    pack_local,
    read_share,
    receive_multimodal,
    send_multimodal,
)
from knitkit.storage.baselines.synthetic import synthetic_trajectories
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.types import UnitKey

FIELDS = ("tokens", "logprobs", "loss_mask", "routing", "topp_mask")
TOPOLOGY = Topology(dp=2, cp=2, tp=2)
ENCODER = EncoderTopology("vision", dp=2)
METHODS = ("knitkit", "sample_level", "transferqueue")
TQ_PARTITION = "transfer-bench"


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
    sliced_units: int
    sliced_rows: int


FULL = Sizes(4, 4, 4096, 16384, 48, 1024, 1176, 4, 8192, 0.05, 16, 16384)
QUICK = Sizes(2, 4, 1024, 4096, 12, 256, 588, 2, 2048, 0.02, 16, 8192)


def build_workload(sizes: Sizes) -> tuple[TrajectoryStore, list[MiniBatchPlan], list[Any], int]:
    """Store trajectories in shared memory; plan each mini-batch; bytes one step consumes."""
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
    plans, consumed = [], 0
    for step in range(sizes.minibatches):
        metas = store.metas([t.trajectory_id for t in trajectories[step * per_step :][:per_step]])
        plans.append(plan_minibatch(metas, TOPOLOGY, config, (ENCODER,), f"mb{step}"))
        units = {UnitKey(m.trajectory_id, f) for m in metas for f in (*FIELDS, "reward")}
        units |= {ref.key for m in metas for ref in m.multimodal}
        consumed += sum(store.backend.spec(k).nbytes for k in units)
    return store, plans, trajectories, consumed


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
        sum(
            store.backend.spec(k).nbytes + 64
            for k in {
                r.key
                for mb in p.consumer(dp, 0).micro_batches
                for s in mb.sequences
                for r in s.multimodal
            }
        )
        for p in plans
        for dp in range(TOPOLOGY.dp)
    )
    return backbone, encoder, images


def rank_main(
    rank: RankPosition,
    backend: SharedMemoryBackend,
    plans: list[MiniBatchPlan],
    rings: dict[tuple[int, int], RingSpec],
    encoder_ring: RingSpec | None,
    multimodal_ring: RingSpec,
    tq_configs: Any,
    compute_s: float,
    barrier: Any,
    results: Any,
) -> None:
    """One training rank: runs every method in turn, reporting per-step waits and bytes read."""
    waits: dict[str, list[float]] = {m: [] for m in METHODS}
    bytes_read: dict[str, int] = dict.fromkeys(METHODS, 0)
    backbone = MicroBatchConsumer(rings[(rank.dp, rank.cp)], rank.tp)
    encoder = MicroBatchConsumer(encoder_ring, 0) if encoder_ring else None
    # Sample-level redistribution of images: TP0/CP0 publishes, its DP group's peers copy.
    images_out: Publisher | None = None
    images_in: MicroBatchConsumer | None = None
    if rank.reads_multimodal:
        images_out = Publisher(SlotRing.attach(multimodal_ring))
        images_out.start()
    else:
        images_in = MicroBatchConsumer(multimodal_ring, rank.cp * TOPOLOGY.tp + rank.tp - 1)

    def share_images(local: LocalTrajectories) -> None:
        if images_out is not None:
            send_multimodal(images_out, local)
        else:
            assert images_in is not None
            receive_multimodal(images_in, local)

    if tq_configs is not None:  # import torch / Ray / TQ while the driver starts TransferQueue
        from knitkit.integration.transferqueue import TransferQueueConnection, read_share_tq
    barrier.wait()
    for plan in plans:
        wait = 0.0
        for _ in plan.encoder("vision").ranks[rank.dp].micro_batches if encoder else ():
            start = time.perf_counter()
            assert encoder is not None
            encoder.next_micro_batch().release()
            wait += time.perf_counter() - start
        for _ in plan.consumer(rank.dp, rank.cp).micro_batches:
            start = time.perf_counter()
            batch = backbone.next_micro_batch()
            wait += time.perf_counter() - start
            time.sleep(compute_s)
            batch.release()
        waits["knitkit"].append(wait)
    backbone.close()
    if encoder:
        encoder.close()

    barrier.wait()
    for plan in plans:
        start = time.perf_counter()
        before = backend.bytes_read
        local = read_share(backend, plan, rank)
        bytes_read["sample_level"] += backend.bytes_read - before
        share_images(local)
        packed = list(pack_local(plan.consumer(rank.dp, rank.cp), local))
        waits["sample_level"].append(time.perf_counter() - start)
        for _ in packed:
            time.sleep(compute_s)

    if tq_configs is not None:
        client = TransferQueueConnection(tq_configs.get()).client()
        barrier.wait()
        for plan in plans:
            start = time.perf_counter()
            local, moved = read_share_tq(client, plan, rank, TQ_PARTITION)
            share_images(local)
            packed = list(pack_local(plan.consumer(rank.dp, rank.cp), local))
            waits["transferqueue"].append(time.perf_counter() - start)
            bytes_read["transferqueue"] += moved
            for _ in packed:
                time.sleep(compute_s)
        client.close()
    if images_out is not None:
        images_out.finish()
        images_out.close()
    elif images_in is not None:
        images_in.close()
    results.put((rank, waits, bytes_read))


def _progress(message: str, start: float = time.perf_counter()) -> None:
    print(f"[{time.perf_counter() - start:6.1f} s] {message}", file=sys.stderr, flush=True)


def run_delivery(sizes: Sizes, with_tq: bool) -> dict[str, float]:
    """The three methods on one workload, consumers as real processes; figures by key."""
    store, plans, trajectories, consumed = build_workload(sizes)
    _progress(f"stored {len(trajectories)} trajectories, planned {len(plans)} mini-batches")
    backbone_bytes, encoder_bytes, image_bytes = slot_bytes(store, plans)
    connection = None
    ctx = mp.get_context("spawn")
    ranks = [RankPosition(d, c, t) for d in range(2) for c in range(2) for t in range(2)]
    barrier, results = ctx.Barrier(len(ranks) + 1), ctx.Queue()
    tq_configs = ctx.Queue() if with_tq else None
    rings = {
        (d, c): RingSpec.new(num_slots=2, slot_bytes=backbone_bytes, num_consumers=TOPOLOGY.tp)
        for d in range(2)
        for c in range(2)
    }
    encoder_rings = [
        RingSpec.new(num_slots=2, slot_bytes=encoder_bytes, num_consumers=1) for _ in range(2)
    ]
    peers = TOPOLOGY.cp * TOPOLOGY.tp - 1
    image_rings = [
        SlotRing.create(RingSpec.new(num_slots=2, slot_bytes=image_bytes, num_consumers=peers))
        for _ in range(TOPOLOGY.dp)
    ]
    reorganizers = [ReorganizerProcess(store.backend, spec) for spec in rings.values()]
    reorganizers += [ReorganizerProcess(store.backend, spec) for spec in encoder_rings]
    processes = []
    try:
        for rank in ranks:
            encoder_ring = encoder_rings[rank.dp] if rank.reads_multimodal else None
            args: tuple[Any, ...] = (rank, store.backend, plans, rings, encoder_ring)
            args += (image_rings[rank.dp].spec, tq_configs, sizes.compute_s)
            process = ctx.Process(target=rank_main, args=(*args, barrier, results))
            process.start()
            processes.append(process)
        if tq_configs is not None:
            from knitkit.integration.transferqueue import put_trajectories, start_transfer_queue

            connection = start_transfer_queue()
            client = connection.client()
            put_trajectories(client, trajectories, TQ_PARTITION)
            client.close()
            for _ in ranks:
                tq_configs.put(connection.config)
            _progress("TransferQueue started and loaded")
        barrier.wait(timeout=300)
        _progress("knitkit phase")
        for plan in plans:
            for reorganizer, group in zip(reorganizers[:4], plan.consumers, strict=True):
                reorganizer.submit(plan.minibatch_id, group)
            for reorganizer, rank_plan in zip(
                reorganizers[4:], plan.encoder("vision").ranks, strict=True
            ):
                reorganizer.submit(plan.minibatch_id, rank_plan)
        barrier.wait(timeout=300)
        _progress("sample-level phase")
        if connection:
            barrier.wait(timeout=300)
            _progress("TransferQueue phase")
        got = [results.get(timeout=600) for _ in ranks]
        _progress("delivery done")
        knitkit_read = sum(r.bytes_read for r in reorganizers)
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
        for reorganizer in reorganizers:
            reorganizer.close()
        for ring in image_rings:
            ring.close()
            ring.unlink()
        store.backend.close()
        if connection:
            from knitkit.integration.transferqueue import stop_transfer_queue

            stop_transfer_queue()
    figures: dict[str, float] = {"bytes_consumed_per_step": consumed / sizes.minibatches}
    for method in METHODS if with_tq else METHODS[:2]:
        per_step = np.array([waits[method] for _, waits, _ in got])  # ranks x steps
        figures[f"{method}.exposed_s_per_step"] = float(per_step.max(axis=0).mean())
        figures[f"{method}.exposed_s_per_step_mean_rank"] = float(per_step.mean())
        read = knitkit_read if method == "knitkit" else sum(b[method] for _, _, b in got)
        figures[f"{method}.bytes_read_ratio"] = read / consumed
    figures["steps"] = sizes.minibatches
    figures["micro_batches_per_step"] = plans[0].num_micro_batches
    return figures


ENGINES = ("ray", "mooncake")
"""Engine backends whose sliced reads ``knitkit.integration.sliced_read.measure`` times."""


def sliced_read_fractions(sizes: Sizes) -> dict[str, float]:
    """Throughput of CP-chunk range reads through each backend against a plain copy of the SAME
    bytes from the same place: a memcpy out of the stored array (memory, shm) or a raw
    ``os.preadv`` of the same file ranges from the page cache (disk, offsets from the header)."""
    from knitkit.storage import MemoryBackend, SafetensorsBackend, cp_chunks

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
                for i, key in enumerate(keys):
                    backend.read(key, ranges, out=out[i])

            seconds = _best(sliced)
            if name == "disk":
                read, fds = _raw_preads(backend.directory, keys, pieces, out)
                ceiling = _best(read)
                for fd in fds:
                    os.close(fd)
            else:
                views = [backend.view(k) for k in keys]
                ceiling = _best(lambda views=views: _copy_pieces(views, pieces, out))
            figures[f"sliced_read.{name}.fraction_of_ceiling"] = ceiling / seconds
            figures[f"sliced_read.{name}.gbps"] = out.nbytes / seconds / 1e9
            figures[f"sliced_read.{name}.ceiling_gbps"] = out.nbytes / ceiling / 1e9
            backend.close()
    return figures


def _copy_pieces(
    views: list[np.ndarray], pieces: list[tuple[int, int, int, int]], out: np.ndarray
) -> None:
    for i, a, b, row in pieces:
        np.copyto(out[i, row : row + b - a], views[i][a:b])


def _raw_preads(
    directory: str, keys: list[UnitKey], pieces: list[tuple[int, int, int, int]], out: np.ndarray
) -> tuple[Any, list[int]]:
    """Plain ``os.preadv`` of the same file ranges the disk backend reads (offsets from headers),
    and the file descriptors to close afterwards."""
    from knitkit.storage.backends.disk import read_header

    entries = {}
    for shard in glob.glob(os.path.join(directory, "*.safetensors")):
        entries.update(read_header(shard))
    fds = {shard: os.open(shard, os.O_RDONLY) for shard in {e.shard for e in entries.values()}}
    row_bytes = out[0, 0].nbytes

    def read() -> None:
        for i, a, b, row in pieces:
            entry = entries[keys[i]]
            target = out[i, row : row + b - a].data
            os.preadv(fds[entry.shard], [target], entry.offset + a * row_bytes)

    return read, list(fds.values())


def _best(fn: Any, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, under a minute")
    parser.add_argument("--json", metavar="PATH", help="write the figures as one flat JSON object")
    parser.add_argument("--skip-tq", action="store_true", help="leave out TransferQueue (no Ray)")
    parser.add_argument(
        "--skip-engines", action="store_true", help="leave out the Ray and Mooncake sliced reads"
    )
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    figures = run_delivery(sizes, with_tq=not args.skip_tq)
    _progress("sliced reads")
    figures.update(sliced_read_fractions(sizes))
    if not args.skip_engines:
        from knitkit.integration.sliced_read import measure

        for engine in ENGINES:
            _progress(f"sliced reads on {engine}")
            figures.update(measure(engine, quick=args.quick))
    _progress("planner")
    figures["planner_ms"] = planner_ms(repeats=3 if args.quick else 5)
    print_table(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1, sort_keys=True)


def print_table(figures: dict[str, float]) -> None:
    print(
        f"DP2 x CP2 x TP2 consumers, {figures['steps']:.0f} steps of "
        f"{figures['micro_batches_per_step']:.0f} micro-batches, "
        f"{figures['bytes_consumed_per_step'] / 2**20:.1f} MiB consumed per step"
    )
    print(f"{'method':<15}{'bytes read / consumed':>24}{'exposed s/step (max rank)':>28}")
    for method in METHODS:
        if f"{method}.bytes_read_ratio" in figures:
            print(
                f"{method:<15}{figures[f'{method}.bytes_read_ratio']:>24.2f}"
                f"{figures[f'{method}.exposed_s_per_step']:>28.4f}"
            )
    knitkit = figures["knitkit.exposed_s_per_step"]
    for method in METHODS[1:]:
        if f"{method}.exposed_s_per_step" in figures:
            ratio = figures[f"{method}.exposed_s_per_step"] / max(knitkit, 1e-9)
            print(f"exposed {method} / knitkit: {ratio:.1f}x")
    print(f"{'sliced read':<15}{'GB/s':>10}{'plain copy GB/s':>18}{'fraction of ceiling':>22}")
    for name in ("memory", "shm", "disk"):
        print(
            f"{name:<15}{figures[f'sliced_read.{name}.gbps']:>10.2f}"
            f"{figures[f'sliced_read.{name}.ceiling_gbps']:>18.2f}"
            f"{figures[f'sliced_read.{name}.fraction_of_ceiling']:>22.2f}"
        )
    for engine in ENGINES:
        if f"sliced_read.{engine}.fraction_of_ceiling" in figures:
            fraction = figures[f"sliced_read.{engine}.fraction_of_ceiling"]
            print(f"{engine:<15}{'':>10}{'':>18}{fraction:>22.2f}")
    print(f"planner (DP32 x CP2 x TP4, 4096 trajectories): {figures['planner_ms']:.1f} ms")


if __name__ == "__main__":
    main()
