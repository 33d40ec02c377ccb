"""One GRPO step on megatron-core, knitkit's path vs the unwrapped loop: data wait, CPU of every process, bytes read.

Runs ``examples/grpo_megatron.py``'s loop under torchrun (4 ranks, DP2 x TP2; gloo on CPU) four times
in one run, on the same admitted mini-batches:

- knitkit: the driver on rank 0 (admission, shared-memory store, one reorganizer process per
  (DP, CP) group and per encoder rank), the Megatron per-rank handle on every rank, three passes
  per step (old log-probs, reference log-probs: forward-only with write-back; train), each
  unique image encoded once per pass. The rollout is fed before the first step (its cost is
  the rollout's, not the data path's), so the driver may serve ahead.
- plain: the same loop without knitkit (``examples/grpo/plain.py``): each rank builds its share
  of the mini-batch from the rollout's outputs (generated before the clock starts), one
  trajectory per micro-batch, the vision path in every micro-batch.
- plain_packed: the plain loop with its share packed like knitkit's micro-batches (whole
  trajectories in admission order, up to the same token budget, block-causal mask), the vision
  path in every micro-batch: the fair baseline for packing (issue 31), so that knitkit's edge
  over it is the data path and dedup, not packing alone.
- plain_dedup: the plain loop (one trajectory per micro-batch, nothing packed) with each unique
  image encoded once per pass of a mini-batch (``examples/grpo/plain_dedup.py``:
  ``knitkit.encoder_dedup``'s routing plan and ``DedupVLMStep``, the same dedup knitkit's path
  runs; routing and loading the images a rank encodes count as its data wait): the fair
  baseline for dedup, so that knitkit's edge over it is packing and the data path (issue 31).
  Added after the other three; it moves none of their figures.

All four run the same model and the same fixed extra compute per token (``--work``: 128 x 128
matmuls per 64 tokens of each micro-batch, real CPU work standing in for a bigger model, not a
sleep), and the same per image row the vision path encodes, wherever it encodes
(``--encoder-work-ratio`` of the per-token work: ``ENCODER_WORK_RATIO``, a real VLM's). Per
step: the exposed data wait (a rank's time in the data path: waiting for a pass, its batches,
encoder inputs, write-backs; for plain, building its share), wall time, the CPU
seconds of every process (the ranks, and each rank's main thread alone: the rest is knitkit's
prefetch and ring threads, rank 0's driver threads, and gloo's communication threads, busier in
the plain loop's many micro-batches; the reorganizers and other children of rank 0), and bytes
read (knitkit: by the reorganizers from the store;
plain: the tokens and images each rank loads), and the ``torch.distributed`` calls each rank
makes (``COUNTED``: megatron's, knitkit's and the loop's collectives, a batch of point-to-point
operations once; each a wait for peers and gloo thread wakes on every rank: a count that load
does not blur). Figures are medians over steps 2.. (step 1 warms up), summed or maxed over ranks
as named.

    python benchmarks/grpo_step.py [--quick] [--json PATH] [--steps N] [--work W]
        [--encoder-work-ratio R]

JSON keys (``<path>`` = knitkit, plain, plain_packed, plain_dedup): ``<path>.exposed_wait_s_per_step`` (max over ranks),
``<path>.exposed_wait_s_per_step.mean_rank``, ``<path>.exposed_wait_s_per_step.<kind>`` (the
slowest rank's wait of one kind: ``pass``, ``encoder_inputs``, ``batch``, ``write_back``,
``done``; ``load`` for plain), ``<path>.step_s``, ``<path>.collectives_per_step`` (the busiest
rank's), ``<path>.cpu_s_per_step``
(every process), ``<path>.cpu_s_per_step.ranks``, ``.rank<r>``, ``.rank<r>.main_thread``,
``<path>.cpu_s_per_step.threads.<kind>`` and ``<path>.wakes_per_step.threads.<kind>`` (every
rank's threads by kind, summed; a wake is a voluntary context switch: a count load does not
blur), ``knitkit.cpu_s_per_step.reorganizers``, ``.other_children`` (and their
``wakes_per_step``), ``<path>.bytes_read_per_step``,
``<path>.images_encoded_per_step``, ``<path>.standin_matmuls_per_step.backbone`` and
``.encoder`` (the stand-in work's matmuls, all ranks), ``steps``, ``work``,
``encoder_work_ratio``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from lifetime import end_on_sigterm

from knitkit.testing import run_to_end

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
WAIT_KINDS = {
    "pass": "waiting for the next pass",
    "encoder_inputs": "reading encoder inputs",
    "first_batch": "a pass's first micro-batch",
    "batch": "its later micro-batches",
    "write_back": "sending write-backs",
    "done": "finishing passes",
    "load": "loading its share (plain)",
}
"""The parts of the exposed data wait (``StepClock`` kinds)."""
PATHS = ("knitkit", "plain", "plain_packed", "plain_dedup")
ENCODER_WORK_RATIO = 0.36
"""The vision path's stand-in work per encoded image row, as a fraction of the backbone's per
token: Qwen2.5-VL-7B's. Its ViT (32 blocks, hidden 1280, MLP 3420: 631 M parameters with the
patch embedding, on 14 x 14 patches) and its 2 x 2 patch merger (44.6 M, once per 4 patches)
cost ~2 x 642.7 M FLOPs per patch; its LLM (Qwen2.5-7B: 6.53 B non-embedding parameters and a
0.545 B output layer) ~2 x 7.075 B per token: 0.091 per patch, before attention. The merger
hands the LLM one token per 4 patches, and a row here is one placeholder token (an LLM token):
4 x 0.091 = 0.36. (LLaVA-1.5-7B, a CLIP ViT-L/14 of 0.30 B on one token per patch against a
6.7 B LLM, would give 0.045.)"""


# ----- inside torchrun: one rank --------------------------------------------------------------
def _task_figures(task: Path) -> tuple[float, int]:
    """One thread's CPU seconds (``schedstat``: nanoseconds, not the 10 ms ticks of ``stat``)
    and its voluntary context switches (each a wake after it blocked: a futex, a poll, the GIL)."""
    cpu = int((task / "schedstat").read_text().split()[0]) / 1e9
    status = (task / "status").read_text()
    return cpu, int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def _children_cpu() -> dict[str, float]:
    """CPU seconds and wakes of this process's descendants, by kind (reorganizers, others),
    summed over their threads, from /proc."""
    out = {
        "reorganizers_cpu_s": 0.0,
        "other_children_cpu_s": 0.0,
        "reorganizers_wakes": 0.0,
        "other_children_wakes": 0.0,
    }
    todo, seen = [os.getpid()], set()
    while todo:
        pid = todo.pop()
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                continue
        if pid == os.getpid() or pid in seen:
            continue
        seen.add(pid)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        # a reorganizer's command line imports its module (NOTE [ Reorganizer child without the
        # launcher's main ] in knitkit/storage/delivery/reorganizer_process.py)
        kind = "reorganizers" if b"reorganizer_process" in cmdline else "other_children"
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                cpu, wakes = _task_figures(task)
            except OSError:  # exited meanwhile
                continue
            out[f"{kind}_cpu_s"] += cpu
            out[f"{kind}_wakes"] += wakes
    return out


Seen = dict[int, tuple[str, float, int]]
"""Every thread of a rank one path's probes saw, by id: its kind, CPU seconds and wakes when
last read (a thread that ended keeps its last figures in its kind)."""


def _threads(seen: Seen) -> dict[str, float]:
    """This rank's CPU seconds and wakes by thread kind (``thread.<kind>.cpu_s`` / ``.wakes``):
    a Python thread's name up to its first digit or ``/`` (``knitkit-pass-end``), a native
    thread's ``comm`` (``native:gloo_tcp_loop``); a thread that ended keeps what the last probe
    read of it. ``thread.exited.cpu_s``: the process's CPU minus every thread's so read, that is
    what threads did after the last probe that saw them (a tail before they ended, or a thread
    that started and ended between two probes); the threads are read in one short pass before
    the process's CPU, so little of what other threads run meanwhile lands there. ``threads_
    started`` / ``threads_ended``: threads seen for the first time / gone since, cumulative."""
    read: dict[int, tuple[float, int]] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            read[int(task.name)] = _task_figures(task)
        except OSError:  # exited meanwhile
            continue
    total = time.process_time()
    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid, (cpu, wakes) in read.items():
        kind = seen[tid][0] if tid in seen else _kind(tid, names.get(tid))
        seen[tid] = (kind, cpu, wakes)
    out: dict[str, float] = {"threads_started": float(len(seen))}
    out["threads_ended"] = float(len(seen) - len(read))
    counted = 0.0
    for kind, cpu, wakes in seen.values():
        out[f"thread.{kind}.cpu_s"] = out.get(f"thread.{kind}.cpu_s", 0.0) + cpu
        out[f"thread.{kind}.wakes"] = out.get(f"thread.{kind}.wakes", 0.0) + wakes
        counted += cpu
    out["thread.exited.cpu_s"] = total - counted
    return out


def _kind(tid: int, name: str | None) -> str:
    """A thread's kind (see ``_threads``)."""
    if name:
        return re.split(r"[\d/]", name, maxsplit=1)[0].rstrip("-_")
    try:
        return f"native:{Path(f'/proc/self/task/{tid}/comm').read_text().strip()}"
    except OSError:
        return "native:?"


COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "all_to_all_single",
    "batch_isend_irecv",
    "send",
    "recv",
)
"""``torch.distributed`` calls a step's ``collectives`` figure counts (a batch of point-to-point
operations counts once; ``isend``/``irecv`` are posted only in such batches here)."""


def _count_collectives() -> Callable[[], dict[str, float]]:
    """Wrap ``COUNTED`` in this rank's ``torch.distributed`` (every caller: megatron, knitkit, the
    loops); returns a probe of the calls so far. A counter increment per call, nothing else."""
    import torch.distributed as dist

    calls = [0]

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return original(*args, **kwargs)

        return call

    for name in COUNTED:
        setattr(dist, name, counting(getattr(dist, name)))
    return lambda: {"collectives": float(calls[0])}


def _worker(out_dir: Path, steps: int, work: float, encoder_ratio: float) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import megatron_common as common
    import torch.distributed as dist
    from grpo.clock import StepClock
    from grpo.config import GRPOConfig
    from grpo.knit import knitkit_loop
    from grpo.plain import _group, plain_loop
    from grpo.plain_dedup import PlainDedup
    from grpo.rollout import parse_trajectory_id
    from grpo.train import StandIn
    from grpo_megatron import new_trainer

    def say(text: str) -> None:
        if dist.get_rank() == 0:
            print(f"[grpo_step] {text}", file=sys.stderr, flush=True)

    run = GRPOConfig(steps=steps)

    def working(trainer: Any) -> Any:
        """``trainer`` with the stand-in work (the same on every path)."""
        trainer.work = StandIn(per_token=work, encoder_ratio=encoder_ratio)
        return trainer

    with common.megatron_world(tensor_parallel=2):
        rank = dist.get_rank()
        collectives = _count_collectives()

        def probe(trainer: Any) -> Callable[[], dict[str, float]]:
            """One path's probe (its own record of the threads it saw, its trainer's stand-in)."""
            seen: Seen = {}

            def probed() -> dict[str, float]:
                ran = {f"standin.{k}": float(v) for k, v in trainer.work.ran.items()}
                children = _children_cpu() if rank == 0 else {}
                return collectives() | _threads(seen) | children | ran

            return probed

        say(f"knitkit path: {steps} steps")
        trainer = working(new_trainer(run))
        knit = knitkit_loop(run, trainer, clock=StepClock(probe(trainer)), feed_ahead=True)
        say("plain loop: the same mini-batches")
        for record in knit:  # the rollout's outputs exist before the plain loop reads them
            for tid in record.trajectory_ids:
                _group(run.rollout, *parse_trajectory_id(tid)[:2])
        plain_trainer = working(new_trainer(run))
        minibatches = [record.trajectory_ids for record in knit]
        plain = plain_loop(run, plain_trainer, minibatches, clock=StepClock(probe(plain_trainer)))
        say("packed plain loop: the same mini-batches")
        packed_trainer = working(new_trainer(run))
        budget = run.max_tokens_per_micro_batch
        packed = plain_loop(
            run,
            packed_trainer,
            minibatches,
            clock=StepClock(probe(packed_trainer)),
            batches_of=lambda samples, sequences, device: packed_batches(
                samples, sequences, device, budget
            ),
        )
        say("dedup-only plain loop: the same mini-batches")
        dedup_trainer = working(new_trainer(run))
        deduped = plain_loop(
            run,
            dedup_trainer,
            minibatches,
            clock=StepClock(probe(dedup_trainer)),
            dedup=PlainDedup(run.rollout),
        )
        histories = {
            "knitkit": knit,
            "plain": plain,
            "plain_packed": packed,
            "plain_dedup": deduped,
        }
        result = {
            path: [{"figures": r.figures, "timings": r.timings} for r in history]
            for path, history in histories.items()
        }
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
        say("done")


def packed_batches(
    samples: list[Any], sequences: int, device: Any, budget: int
) -> list[dict[str, object]]:
    """The plain loop's share packed without knitkit: whole trajectories in admission order into
    micro-batches of at most ``budget`` tokens (a longer one alone), as ``[1, T]`` batches with
    a block-causal mask, per-sequence positions and every trajectory's image in order."""
    import torch
    from grpo.loss import token_weights

    from knitkit.encoder_dedup import segment_ids

    groups: list[list[Any]] = []
    for sample in samples:
        if not groups or sum(len(s.tokens) for s in groups[-1]) + len(sample.tokens) > budget:
            groups.append([])
        groups[-1].append(sample)
    out = []
    for group in groups:
        lengths = torch.tensor([len(s.tokens) for s in group])
        total = int(lengths.sum())
        owner = segment_ids(lengths, total)
        mask = torch.ones(total, total, dtype=torch.bool).triu(1) | (owner[:, None] != owner[None])
        loss_mask = torch.from_numpy(np.concatenate([s.loss_mask for s in group]))

        def cat(name: str, group: list[Any] = group) -> torch.Tensor:
            return torch.from_numpy(np.concatenate([getattr(s, name) for s in group]))[None]

        def per_token(name: str, group: list[Any] = group) -> torch.Tensor:
            values = [torch.full((len(s.tokens),), getattr(s, name)) for s in group]
            return torch.cat(values)[None].to(device)

        out.append(
            {
                "tokens": cat("tokens").to(device),
                "labels": cat("labels").to(device),
                "loss_mask": loss_mask[None].to(device),
                "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()])[None].to(
                    device
                ),
                "attention_mask": mask[None, None].to(device),
                "images": [
                    (pixels, 0, len(pixels))
                    for pixels in (torch.from_numpy(s.image).to(device) for s in group)
                ],
                "advantage": per_token("advantage"),
                "reward": per_token("reward"),
                "weights": token_weights(loss_mask, lengths, sequences)[None].to(device),
            }
        )
    return out


# ----- the launcher: torchrun, then the table ---------------------------------------------------
def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


Ranks = list[dict[str, list[dict[str, dict[str, float]]]]]
"""Per rank, per path, per step: ``{"figures": ..., "timings": ...}`` as the workers wrote it."""


def _series(ranks: Ranks, path: str, key: str) -> list[list[float]]:
    """``[step][rank]`` values of one timing over the measured steps (2.., or 1 if alone)."""
    steps = len(ranks[0][path])
    measured = range(1, steps) if steps > 1 else range(steps)
    return [[rank[path][s]["timings"].get(key, 0.0) for rank in ranks] for s in measured]


def summarise(ranks: Ranks) -> dict[str, float]:
    """The flat figures: medians over the measured steps."""
    out: dict[str, float] = {}
    for path in PATHS:
        waits = _series(ranks, path, "data_wait_s")
        out[f"{path}.exposed_wait_s_per_step"] = _median([max(w) for w in waits])
        out[f"{path}.exposed_wait_s_per_step.mean_rank"] = _median([sum(w) / WORLD for w in waits])
        kinds = sorted(
            {k for rank in ranks for step in rank[path] for k in step["timings"]} - {"data_wait_s"}
        )
        for kind in (k for k in kinds if k.startswith("data_wait_s.")):
            name = kind.removeprefix("data_wait_s.")
            out[f"{path}.exposed_wait_s_per_step.{name}"] = _median(
                [max(w) for w in _series(ranks, path, kind)]
            )
        out[f"{path}.step_s"] = _median([max(w) for w in _series(ranks, path, "wall_s")])
        out[f"{path}.collectives_per_step"] = _median(
            [max(c) for c in _series(ranks, path, "collectives")]
        )
        cpu = _series(ranks, path, "cpu_s")
        main = _series(ranks, path, "main_thread_cpu_s")
        for r in range(WORLD):
            out[f"{path}.cpu_s_per_step.rank{r}"] = _median([step[r] for step in cpu])
            out[f"{path}.cpu_s_per_step.rank{r}.main_thread"] = _median([step[r] for step in main])
        ranks_cpu = _median([sum(step) for step in cpu])
        out[f"{path}.cpu_s_per_step.ranks"] = ranks_cpu
        children = 0.0
        for kind in ("reorganizers", "other_children"):  # probed on rank 0 only
            value = _median([step[0] for step in _series(ranks, path, f"{kind}_cpu_s")])
            children += value
            if path == "knitkit":
                out[f"{path}.cpu_s_per_step.{kind}"] = value
                out[f"{path}.wakes_per_step.{kind}"] = _median(
                    [step[0] for step in _series(ranks, path, f"{kind}_wakes")]
                )
        out[f"{path}.cpu_s_per_step"] = ranks_cpu + children
        for key in (k for k in kinds if k.startswith("thread.")):
            thread, _, figure = key.removeprefix("thread.").rpartition(".")
            name = "cpu_s_per_step" if figure == "cpu_s" else "wakes_per_step"
            out[f"{path}.{name}.threads.{thread}"] = _median(
                [sum(step) for step in _series(ranks, path, key)]
            )
        for part in ("backbone", "encoder"):
            out[f"{path}.standin_matmuls_per_step.{part}"] = _median(
                [sum(step) for step in _series(ranks, path, f"standin.{part}")]
            )
        for figure in ("threads_started", "threads_ended"):
            out[f"{path}.{figure}_per_step"] = _median(
                [sum(step) for step in _series(ranks, path, figure)]
            )
        out[f"{path}.bytes_read_per_step"] = _median(
            [sum(step) for step in _series(ranks, path, "bytes_read")]
        )
        steps = len(ranks[0][path])
        out[f"{path}.images_encoded_per_step"] = _median(
            [
                ranks[0][path][s]["figures"]["images_encoded"]
                for s in range(min(1, steps - 1), steps)
            ]
        )
    return out


def _table(figures: dict[str, float]) -> str:
    rows = [
        ("exposed data wait per step, slowest rank (s)", "exposed_wait_s_per_step", "{:.4f}"),
        ("  mean over ranks (s)", "exposed_wait_s_per_step.mean_rank", "{:.4f}"),
        *(
            (f"  {label}, slowest rank (s)", f"exposed_wait_s_per_step.{kind}", "{:.4f}")
            for kind, label in WAIT_KINDS.items()
        ),
        ("step wall time (s)", "step_s", "{:.3f}"),
        ("collective calls per step, busiest rank", "collectives_per_step", "{:.0f}"),
        ("threads started per step, all ranks", "threads_started_per_step", "{:.0f}"),
        ("threads ended per step, all ranks", "threads_ended_per_step", "{:.0f}"),
        (
            "stand-in matmuls per step, all ranks: backbone",
            "standin_matmuls_per_step.backbone",
            "{:.0f}",
        ),
        ("  vision path", "standin_matmuls_per_step.encoder", "{:.0f}"),
        ("CPU s per step, every process", "cpu_s_per_step", "{:.3f}"),
        ("  the 4 ranks (rank 0 with the driver)", "cpu_s_per_step.ranks", "{:.3f}"),
        *(
            (f"  rank {r} (main thread)", f"cpu_s_per_step.rank{r}.main_thread", "{:.3f}")
            for r in range(WORLD)
        ),
        ("  reorganizer processes", "cpu_s_per_step.reorganizers", "{:.3f}"),
        ("  other children of rank 0", "cpu_s_per_step.other_children", "{:.3f}"),
        ("bytes read per step", "bytes_read_per_step", "{:,.0f}"),
        ("image encodings per train pass", "images_encoded_per_step", "{:.0f}"),
    ]
    header = "".join(f"{path:>14}" for path in PATHS)
    lines = [f"{'per step (median over steps 2..)':<46}{header}"]
    for label, key, fmt in rows:
        cells = []
        for path in PATHS:
            value = figures.get(f"{path}.{key}")
            cells.append(fmt.format(value) if value is not None else "-")
        lines.append(f"{label:<46}" + "".join(f"{cell:>14}" for cell in cells))
    return "\n".join(lines)


def _thread_table(figures: dict[str, float]) -> str:
    """Every thread kind's CPU (ms) and wakes per step, summed over the 4 ranks."""
    threads = sorted(
        {k.partition(".threads.")[2] for k in figures if ".threads." in k},
        key=lambda t: -figures.get(f"knitkit.cpu_s_per_step.threads.{t}", 0.0),
    )
    header = "".join(f"{path:>14}" for path in PATHS)
    lines = [f"{'threads, all ranks: CPU ms / wakes per step':<46}{header}"]
    for thread in threads:
        cells = []
        for path in PATHS:
            cpu = figures.get(f"{path}.cpu_s_per_step.threads.{thread}")
            wakes = figures.get(f"{path}.wakes_per_step.threads.{thread}")
            cell = "-" if cpu is None else f"{1000 * cpu:.1f}"
            cells.append(cell if wakes is None else f"{cell} / {wakes:.0f}")
        lines.append(f"  {thread:<44}" + "".join(f"{cell:>14}" for cell in cells))
    return "\n".join(lines)


def main() -> int:
    end_on_sigterm()  # a SIGTERM ends torchrun and its workers too (lifetime.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="3 optimizer steps instead of 6, the same step"
    )
    parser.add_argument("--json", metavar="PATH", help="write the flat JSON figures here")
    parser.add_argument("--steps", type=int, help="optimizer steps per path (default 6, quick 3)")
    parser.add_argument(
        "--work", type=float, help="matmuls per 64 tokens per micro-batch (default 8)"
    )
    parser.add_argument(
        "--encoder-work-ratio",
        type=float,
        default=ENCODER_WORK_RATIO,
        help="the vision path's work per encoded image row, as a fraction of --work's per token"
        f" (default {ENCODER_WORK_RATIO}: Qwen2.5-VL-7B's; 0: none)",
    )
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 6)
    work = args.work if args.work is not None else 8.0
    if args.worker:
        _worker(Path(args.worker), steps, work, args.encoder_work_ratio)
        return 0
    ratio = args.encoder_work_ratio
    print(
        f"[grpo_step] torchrun: {WORLD} ranks, {steps} steps, work {work}, encoder {ratio}",
        file=sys.stderr,
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grpo-step-") as tmp:
        command = [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD)),
            str(Path(__file__).resolve()),
            *("--worker", tmp, "--steps", str(steps), "--work", str(work)),
            *("--encoder-work-ratio", str(ratio)),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        done = run_to_end(command, timeout_s=1200, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        if done.returncode:
            print(f"[grpo_step] torchrun failed with code {done.returncode}", file=sys.stderr)
            return done.returncode
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(WORLD)]
    figures = summarise(ranks) | {"steps": float(steps), "work": work}
    figures["encoder_work_ratio"] = ratio
    print(_table(figures))
    print(_thread_table(figures))
    print(f"[grpo_step] {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
