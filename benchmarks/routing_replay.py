"""MoE routing replay benchmark: per-rank bytes read and peak host memory of the ``routing`` field,
knitkit vs sample-level vs TransferQueue.

Workload (``--quick`` runs the same sizes over fewer mini-batches): SGLang's ``routed_experts``
of a 48-layer top-8 MoE stored as uint8 ``[tokens, 48, 8]`` (384 bytes per token), 16,384-token
trajectories, GRPO groups of 8, mini-batches of 2 groups, a DP2 x CP2 x TP2 x PP2 trainer (16
ranks; sequence parallel, so a TP rank's routers see half of its CP rank's tokens), micro-batches
of one trajectory's CP share (8,192 tokens). What each method does for one mini-batch:

- knitkit: each pipeline stage of a (DP, CP) group has its own ring (NOTE [ One ring per
  pipeline stage ]); its reorganizer reads its CP chunks of every trajectory x its stage's 24
  layers (one 2-D read per trajectory: ``PlannerConfig(stage_layers=...)``) micro-batch by
  micro-batch into one shared-memory slot; each of the stage's 2 TP ranks takes its
  sequence-parallel half of the tokens from the slot (``routing_replay.stage_rows``), what it
  hands to ``RouterReplay``.
- sample_level: every rank reads its DP share's whole trajectories (every token, every layer) and
  packs its micro-batches from them, as the anchors do (slime#2384 broadcasts even the whole
  rollout to every rank).
- transferqueue: every rank gets its DP share's whole rows from TransferQueue (``kv_retrieve_meta``
  + ``get_data``, one row per trajectory), as a TQ user does.

Counted per rank: ``bytes_read`` (storage bytes; knitkit's stage ring's read divided among the 2
TP ranks that share it), ``bytes_consumed`` (the rows its routers replay, uint8) and the peak host memory
growth (peak resident set size, reset before, minus the resident size before) of a fresh process
holding its own copy of the store (so the figure counts what the data path allocates, not the
store's pages it touches) doing one representative rank's data
path for a mini-batch (knitkit: the reorganizer's slot counted as the rank's own, an upper bound:
one slot serves the stage's 2 TP ranks).

    python benchmarks/routing_replay.py [--quick] [--json PATH] [--skip-tq]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lifetime import die_with_parent, end_on_sigterm
from progress import Progress

from knitkit.integration.megatron.routing_replay import stage_rows
from knitkit.storage import (
    MemoryBackend,
    PlannerConfig,
    Topology,
    Trajectory,
    TrajectoryStore,
    plan_minibatch,
)
from knitkit.storage.baselines import LocalTrajectories, RankPosition, read_share
from knitkit.storage.planning import StageLayers, pack_into, pack_into_batched, pack_layout

LAYERS, TOPK, EXPERTS = 48, 8, 128
TOKENS, GROUP, GROUPS_PER_MINIBATCH = 16_384, 8, 2
DP, CP, TP, PP = 2, 2, 2, 2
METHODS = ("knitkit", "sample_level", "transferqueue")
FIELDS = ("tokens", "routing")


@dataclass(frozen=True, slots=True)
class Sizes:
    """One run's sizes; ``--quick`` changes only ``minibatches``."""

    minibatches: int


FULL, QUICK = Sizes(minibatches=3), Sizes(minibatches=1)


def trajectories(minibatch: int) -> list[Trajectory]:
    """One mini-batch: GRPO groups of 8 trajectories with random expert ids."""
    rng = np.random.default_rng(minibatch)
    out = []
    for g in range(GROUPS_PER_MINIBATCH):
        for i in range(GROUP):
            routing = rng.integers(0, EXPERTS, (TOKENS, LAYERS, TOPK), dtype=np.uint8)
            tokens = rng.integers(0, 50_000, TOKENS, dtype=np.int32)
            fields = {"tokens": tokens, "routing": routing}
            out.append(Trajectory(f"m{minibatch}-{g}-{i}", f"m{minibatch}-{g}", fields))
    return out


def plan(store: TrajectoryStore, minibatch: int) -> Any:
    ids = [f"m{minibatch}-{g}-{i}" for g in range(GROUPS_PER_MINIBATCH) for i in range(GROUP)]
    per_stage = LAYERS // PP
    config = PlannerConfig(
        token_fields=("routing",),
        scalar_fields=(),
        max_tokens_per_micro_batch=TOKENS // CP,
        stage_layers=StageLayers(
            tuple((s * per_stage, (s + 1) * per_stage) for s in range(PP)), ("routing",)
        ),
    )
    topology = Topology(dp=DP, cp=CP, tp=TP, sequence_parallel=True)
    return plan_minibatch(store.metas(ids), topology, config)


def _consumed(group: Any) -> int:
    """uint8 bytes one rank's routers replay for its (DP, CP) group's micro-batches."""
    tokens = sum(mb.num_tokens for mb in group.micro_batches)
    return tokens // TP * (LAYERS // PP) * TOPK


def _knitkit_rank(backend: MemoryBackend, plan: Any, rank: RankPosition) -> dict[str, int]:
    """Stage 0's reorganizer of the group packing its layers into one reused slot (2-D reads),
    and one rank's take per micro-batch."""
    stage = plan.consumer(rank.dp, rank.cp).for_stage(0, plan.stage_layers)
    schema = {"routing": ("uint8", (LAYERS, TOPK))}
    slot = np.empty(max(pack_layout(mb, schema).nbytes for mb in stage.micro_batches), np.uint8)
    before = backend.bytes_read
    taken = 0
    for mb in stage.micro_batches:
        layout = pack_layout(mb, schema)
        views = pack_into_batched(mb, layout, slot, backend.read_many)
        rows = stage_rows(torch.from_numpy(views["routing"]), rank.tp, TP)
        taken += rows.contiguous().numel()  # what goes to the device for RouterReplay
    return {"read": (backend.bytes_read - before) // TP, "consumed": taken}


def _sample_level_rank(backend: MemoryBackend, plan: Any, rank: RankPosition) -> dict[str, int]:
    """The rank's DP share read whole (every token, every layer), then its micro-batches packed."""
    before = backend.bytes_read
    local = read_share(backend, plan, rank)
    return {"read": backend.bytes_read - before, "consumed": _take_from_share(local, plan, rank)}


def _tq_rank(config: Any, plan: Any, rank: RankPosition) -> dict[str, int]:
    """The rank's DP share's whole rows from TransferQueue, then its slice of each."""
    from knitkit.integration.transferqueue import TransferQueueConnection, read_share_tq

    client = TransferQueueConnection(config).client()
    local, moved = read_share_tq(client, plan, rank, "routing")
    taken = _take_from_share(local, plan, rank)
    client.close()
    return {"read": moved, "consumed": taken}


def _take_from_share(local: LocalTrajectories, plan: Any, rank: RankPosition) -> int:
    """Pack the rank's micro-batches from its DP share read whole (``local``),
    one buffer each, and take its rows of stage 0; the elements taken."""
    group = plan.consumer(rank.dp, rank.cp)
    taken = 0
    for mb in group.micro_batches:
        layout = pack_layout(mb, local.schema(mb))
        buffer = np.empty(layout.nbytes, np.uint8)
        views = pack_into(mb, layout, buffer, local.read_into)
        rows = stage_rows(torch.from_numpy(views["routing"]), rank.tp, TP)[:, : LAYERS // PP]
        taken += rows.contiguous().numel()
    return taken


def _measure(method: str, source: Any, plans: list[Any], out: Any) -> None:
    """In a fresh process: one representative rank's data path per mini-batch, with its peak
    host memory growth (Linux's peak resident set size, reset before each mini-batch)."""
    die_with_parent()
    rank = RankPosition(dp=0, cp=1, tp=1)  # not TP0/CP0: those also fetch images
    run = {"knitkit": _knitkit_rank, "sample_level": _sample_level_rank}.get(method, _tq_rank)
    figures = []
    try:
        for plan_ in plans:
            with open("/proc/self/clear_refs", "w") as file:
                file.write("5")  # resets the peak resident set size (VmHWM) to the current one
            base = _status_kib("VmRSS")
            got = run(source, plan_, rank)
            got["peak"] = (_status_kib("VmHWM") - base) * 1024
            figures.append(got)
    except BaseException:
        out.put(traceback.format_exc())
        raise
    out.put(figures)


def _status_kib(key: str) -> int:
    """A ``/proc/self/status`` memory figure, KiB."""
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    raise KeyError(key)


def measure(method: str, source: Any, plans: list[Any]) -> dict[str, float]:
    """Per-rank figures of ``method``: medians over the mini-batches."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(method, source, plans, out))
    proc.start()
    figures = None
    deadline = time.monotonic() + 600
    while figures is None:
        try:
            figures = out.get(timeout=1)
        except queue.Empty:
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{method}: the measuring process died or hung") from None
    proc.join(60)
    if isinstance(figures, str):
        raise RuntimeError(f"{method}: the measuring process failed:\n{figures}")
    # the first mini-batch pays the allocator's growth; later ones reuse it (peak is a maximum)
    peak = max(f["peak"] for f in figures)
    read = statistics.median(f["read"] for f in figures)
    consumed = statistics.median(f["consumed"] for f in figures)
    return {
        f"{method}.bytes_read_per_rank": float(read),
        f"{method}.bytes_consumed_per_rank": float(consumed),
        f"{method}.bytes_read_ratio": read / consumed,
        f"{method}.peak_host_bytes_per_rank": float(peak),
    }


def main() -> None:
    end_on_sigterm()  # a SIGTERM ends the measuring process too (lifetime.py)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="same sizes, fewer mini-batches")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--skip-tq", action="store_true", help="leave TransferQueue out")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    progress = Progress("routing_replay")
    figures: dict[str, float] = {"loadavg_1m_at_start": os.getloadavg()[0]}
    backend = MemoryBackend()
    store = TrajectoryStore(backend)
    written = []
    for m in range(sizes.minibatches):
        written.append(trajectories(m))
        for trajectory in written[-1]:
            store.write(trajectory)
    plans = [plan(store, m) for m in range(sizes.minibatches)]
    progress(
        f"stored {sizes.minibatches} mini-batches of {GROUP * GROUPS_PER_MINIBATCH} x {TOKENS} tokens"
    )
    for method in ("knitkit", "sample_level"):
        figures.update(measure(method, backend, plans))
        progress(method)
    if not args.skip_tq:
        from knitkit.integration.transferqueue import (
            put_trajectories,
            start_transfer_queue,
            stop_transfer_queue,
        )

        connection = start_transfer_queue()
        try:
            client = connection.client()
            for batch in written:
                put_trajectories(client, batch, "routing")
            client.close()
            progress("TransferQueue started and loaded")
            figures.update(measure("transferqueue", connection.config, plans))
            progress("transferqueue")
        finally:
            stop_transfer_queue()
    for method in METHODS[1:]:
        if f"{method}.bytes_read_per_rank" in figures:
            for what in ("bytes_read_per_rank", "peak_host_bytes_per_rank"):
                figures[f"{method}_over_knitkit.{what}"] = (
                    figures[f"{method}.{what}"] / figures[f"knitkit.{what}"]
                )
    figures["loadavg_1m_at_end"] = os.getloadavg()[0]
    store.close()
    _print(figures)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=1, sort_keys=True)


def _print(figures: dict[str, float]) -> None:
    mib = 1 << 20
    print(
        f"routing [tokens, {LAYERS}, {TOPK}] uint8, {TOKENS}-token trajectories, GRPO {GROUP}, "
        f"DP{DP} x CP{CP} x TP{TP} x PP{PP}; per rank, one mini-batch"
    )
    print(
        f"{'method':<14}{'read MiB':>10}{'consumed MiB':>14}{'read/consumed':>15}{'peak MiB':>10}"
    )
    for method in METHODS:
        if f"{method}.bytes_read_per_rank" not in figures:
            continue
        print(
            f"{method:<14}{figures[f'{method}.bytes_read_per_rank'] / mib:>10.1f}"
            f"{figures[f'{method}.bytes_consumed_per_rank'] / mib:>14.1f}"
            f"{figures[f'{method}.bytes_read_ratio']:>15.2f}"
            f"{figures[f'{method}.peak_host_bytes_per_rank'] / mib:>10.1f}"
        )
    for method in METHODS[1:]:
        key = f"{method}_over_knitkit.bytes_read_per_rank"
        if key in figures:
            print(
                f"{method} / knitkit: bytes read {figures[key]:.1f}x, peak host memory "
                f"{figures[f'{method}_over_knitkit.peak_host_bytes_per_rank']:.1f}x"
            )


if __name__ == "__main__":
    main()
