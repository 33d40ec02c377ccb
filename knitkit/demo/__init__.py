"""End-to-end demo: rollout stand-in -> admission -> shared-memory store -> planner -> reorganizer
processes -> prefetch iterator -> a small VLM trained with encoder dedup over DP x CP gloo ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from knitkit.admission.replay import ProgressBar, preset, run_replay
from knitkit.demo.model import ModelSize
from knitkit.demo.pipeline import PipelineConfig, run_pipeline
from knitkit.demo.report import plot_report, print_report, summarize
from knitkit.demo.rollout import RolloutConfig, default_sources

REPLAY_POLICIES = ["barrier", "linear", "knittrans", "adaptive"]


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
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    paper4 = preset("paper4")
    settings = paper4.settings.with_(
        train_batches=args.replay_train_batches, warmup=4, seed=args.seed
    )
    progress = ProgressBar(settings.train_batches * (len(REPLAY_POLICIES) + 1), "trace replay")
    replay = run_replay(paper4.trace(settings), settings, REPLAY_POLICIES, progress)
    _say(f"trace replay done ({', '.join(REPLAY_POLICIES)} on the paper4 preset)")
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
    config = PipelineConfig(
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
    live = run_pipeline(config, _say)
    figures = summarize(replay, live)
    print_report(figures, REPLAY_POLICIES)
    (args.out / "report.json").write_text(json.dumps(figures, indent=2))
    plot_report(figures, live, args.out / "demo.png")
    from knitkit.admission.replay import plot_replay

    plot_replay(replay, args.out / "replay.png")
    print(
        f"\nwrote {args.out / 'report.json'}, {args.out / 'demo.png'}, {args.out / 'replay.png'}"
        f" in {time.perf_counter() - started:.0f} s"
    )
    return 0


def _say(message: str) -> None:
    print(f"[knitkit demo] {message}", file=sys.stderr, flush=True)
