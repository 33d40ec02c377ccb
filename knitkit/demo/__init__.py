"""End-to-end demo: rollout stand-in -> a knitkit.job Driver (admission, shared-memory store,
planner, reorganizer processes) -> DP x CP gloo ranks, each a RankHandle, running two passes per
mini-batch (old log-probs, forward-only and written back; then training with encoder dedup).

Prints a progress line per optimizer step and a report at the end; each step's knitkit/... figures
(admission, storage, delivery, job, dedup, loss) go to OUT/tensorboard (`tensorboard --logdir
OUT`) and OUT/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import AbstractContextManager, ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from knitkit.admission.replay import ProgressBar, preset, run_replay
from knitkit.demo.model import ModelSize
from knitkit.demo.pipeline import PipelineConfig, run_pipeline
from knitkit.demo.report import plot_report, print_report, summarize
from knitkit.demo.rollout import RolloutConfig, default_sources
from knitkit.demo.trainer import LOSS
from knitkit.metrics import (
    FanOut,
    JsonlObserver,
    MetricsObserver,
    ProgressLine,
    TensorBoardObserver,
)

REPLAY_POLICIES = ["barrier", "linear", "knittrans", "adaptive"]
SINKS = ("tensorboard", "jsonl")
PROGRESS = {
    "loss": LOSS,
    "staleness": "knitkit/admission/last_minibatch/staleness_mean",
    "units live": "knitkit/storage/units_live",
}
"""Figures on each step's progress line (label -> name)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, default=Path("knitkit-out"), help="folder for plots and JSON"
    )
    parser.add_argument("--dp", type=int, default=2, help="backbone data-parallel ranks")
    parser.add_argument("--cp", type=int, default=2, help="backbone context-parallel ranks")
    parser.add_argument(
        "--encoder-dp", type=int, default=2, help="vision encoder data-parallel ranks"
    )
    parser.add_argument("--group-size", type=int, default=8, help="GRPO rollouts per prompt (n)")
    parser.add_argument(
        "--train-batch-size", type=int, default=64, help="trajectories per train batch"
    )
    parser.add_argument(
        "--minibatches", type=int, default=4, help="mini-batches (optimizer steps) per train batch"
    )
    parser.add_argument("--train-batches", type=int, default=3, help="train batches to train on")
    parser.add_argument(
        "--quota", type=float, default=0.24, help="lower-bound share of each of the 4 sources"
    )
    parser.add_argument("--max-tokens", type=int, default=240, help="longest trajectory (tokens)")
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=192,
        help="token budget of one micro-batch per rank",
    )
    parser.add_argument("--prefetch-depth", type=int, default=2, help="micro-batches staged ahead")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument(
        "--replay-train-batches", type=int, default=16, help="train batches in the trace replay"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the rollout stand-in and the trace replay"
    )
    parser.add_argument(
        "--metrics",
        type=_sinks,
        default="tensorboard,jsonl",
        help="where each step's knitkit/... figures go, comma-separated: tensorboard "
        "(OUT/tensorboard/, needs knitkit[tensorboard]), jsonl (OUT/metrics.jsonl), or none",
    )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:  # sinks first: a missing extra fails before any work
        sinks = [stack.enter_context(_open(sink, args.out)) for sink in args.metrics]
        replay = _replay(args)
        config = _pipeline_config(args)
        progress = ProgressLine(config.train_batches * config.num_minibatches, PROGRESS, say=_say)
        live = run_pipeline(config, _say, FanOut(*sinks, progress))
    figures = summarize(replay, live)
    print_report(figures, REPLAY_POLICIES)
    (args.out / "report.json").write_text(json.dumps(figures, indent=2))
    plot_report(figures, live, args.out / "demo.png")
    from knitkit.admission.replay import plot_replay

    plot_replay(replay, args.out / "replay.png")
    written = [args.out / "report.json", args.out / "demo.png", args.out / "replay.png"]
    written += [_path(sink, args.out) for sink in args.metrics]
    print(f"\nwrote {', '.join(map(str, written))} in {time.perf_counter() - started:.0f} s")
    return 0


def _replay(args: argparse.Namespace) -> dict[str, Any]:
    """The trace replay of the admission policies on the paper4 preset."""
    paper4 = preset("paper4")
    settings = paper4.settings.with_(
        train_batches=args.replay_train_batches, warmup=4, seed=args.seed
    )
    progress = ProgressBar(settings.train_batches * (len(REPLAY_POLICIES) + 1), "trace replay")
    replay = run_replay(paper4.trace(settings), settings, REPLAY_POLICIES, progress)
    _say(f"trace replay done ({', '.join(REPLAY_POLICIES)} on the paper4 preset)")
    return replay


def _pipeline_config(args: argparse.Namespace) -> PipelineConfig:
    rollout = RolloutConfig(
        default_sources(),
        group_size=args.group_size,
        groups_per_source_per_step=max(
            1, round(1.5 * args.train_batch_size / (4 * args.group_size))
        ),
        rollout_steps=args.train_batches + 1,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    return PipelineConfig(
        rollout=rollout,
        dp=args.dp,
        cp=args.cp,
        encoder_dp=args.encoder_dp,
        train_batch_size=args.train_batch_size,
        num_minibatches=args.minibatches,
        train_batches=args.train_batches,
        quota_ratio=args.quota,
        max_tokens_per_micro_batch=args.micro_batch_tokens,
        prefetch_depth=args.prefetch_depth,
        lr=args.lr,
        size=replace(ModelSize(), patch_dim=rollout.patch_dim, vocab=rollout.vocab),
    )


def _sinks(text: str) -> tuple[str, ...]:
    """``--metrics``: the sinks named, or none."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if names == ("none",):
        return ()
    unknown = [n for n in names if n not in SINKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: name sinks from {', '.join(SINKS)} (comma-separated), or none"
        )
    return names


def _path(sink: str, out: Path) -> Path:
    return out / ("tensorboard" if sink == "tensorboard" else "metrics.jsonl")


def _open(sink: str, out: Path) -> AbstractContextManager[MetricsObserver]:
    """A fresh sink in ``out``: this run's figures replace the last run's, as report.json does."""
    path = _path(sink, out)
    if sink == "jsonl":
        return JsonlObserver(path)
    for old in path.glob("events.out.tfevents.*"):
        old.unlink()
    try:
        return TensorBoardObserver(path)
    except ImportError as error:
        raise SystemExit(f"knitkit demo: {error}; or pass --metrics jsonl") from error


def _say(message: str) -> None:
    print(f"[knitkit demo] {message}", file=sys.stderr, flush=True)
