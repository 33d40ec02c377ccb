"""Replay a rollout trace under admission policies; print architectural staleness and quota violations."""

from __future__ import annotations

import argparse
import json
import sys

from knitkit.admission.policies import POLICY_NAMES, describe
from knitkit.admission.replay.runner import ProgressBar, Summary, run_replay
from knitkit.admission.replay.settings import PRESETS, ReplaySettings, preset
from knitkit.admission.replay.trace import Trace, read_jsonl


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the epilog's line breaks and shows defaults."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "policies:\n" + "\n".join(f"  {p:<10} {describe(p)}" for p in POLICY_NAMES)
    parser.epilog += "\npresets:\n" + "\n".join(
        f"  {n:<10} {p.description}" for n, p in PRESETS.items()
    )
    parser.formatter_class = _HelpFormatter
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", help="JSONL trace (one trajectory a line; see admission README)")
    source.add_argument(
        "--preset", default="paper4", choices=sorted(PRESETS), help="built-in workload"
    )
    parser.add_argument(
        "--policies", default=",".join(POLICY_NAMES), help="comma-separated policies"
    )
    parser.add_argument("--minibatches", type=int, default=4, help="mini-batches per train batch")
    parser.add_argument("--train-batches", type=int, default=None, help="train batches to replay")
    parser.add_argument(
        "--rho", type=float, default=None, help="training time / rollout-step length"
    )
    parser.add_argument("--seed", type=int, default=None, help="trace seed (presets only)")
    parser.add_argument(
        "--quotas", default=None, help="lower bounds for --trace, e.g. A=0.24,B=0.24"
    )
    parser.add_argument("--json", dest="json_out", default=None, help="write the summary here")
    parser.add_argument("--plot", default=None, help="write a PNG figure here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _load(args: argparse.Namespace) -> tuple[Trace, ReplaySettings]:
    changes: dict[str, object] = {"num_minibatches": args.minibatches}
    if args.train_batches is not None:
        changes["train_batches"] = args.train_batches
        changes["warmup"] = max(1, min(6, args.train_batches // 4))
    if args.rho is not None:
        changes["rho"] = args.rho
    if args.trace is None:
        chosen = preset(args.preset)
        if args.seed is not None:
            changes["seed"] = args.seed
        settings = chosen.settings.with_(**changes)
        return chosen.trace(settings), settings
    trace = read_jsonl(args.trace)
    if args.quotas:
        ratios = _parse_quotas(args.quotas)
    else:
        ratios = dict.fromkeys(trace.sources, 0.96 / len(trace.sources))
    settings = ReplaySettings(quota_ratios=ratios, **changes)  # type: ignore[arg-type]
    return trace, settings


def _parse_quotas(text: str) -> dict[str, float]:
    ratios = {}
    for item in text.split(","):
        source, sep, value = item.partition("=")
        try:
            ratios[source.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not source.strip():
            raise ValueError(f"--quotas item {item!r}: expected SOURCE=RATIO, e.g. math=0.45")
    return ratios


def format_table(summary: Summary) -> str:
    """A fixed-width table of the per-policy figures."""
    head = f"{'policy':<10} {'arch.stale':>10} {'(oldest)':>9} {'violations':>10} {'steps':>5} {'mix skew':>8} {'1st-MB frac':>11} {'idle':>5}"
    lines = [head, "-" * len(head)]
    for name, p in summary["policies"].items():
        lines.append(
            f"{name:<10} {p['architectural_staleness']:>10.3f} {p['architectural_staleness_start']:>9.3f} "
            f"{p['violations']:>10d} {p['steps']:>5d} {p['mix_skew']:>8.3f} "
            f"{p['first_minibatch_fraction']:>11.2f} {p['trainer_idle_fraction']:>5.2f}"
        )
    lines.append(
        f"rho={summary['rho']:.2f}  rollout step={summary['rollout_step_s']:.0f} s  "
        f"colocated staleness={summary['colocated_staleness']:.3f}"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        trace, settings = _load(args)
        bar = (
            None
            if args.quiet
            else ProgressBar(settings.train_batches * (len(policies) + 1), "replay")
        )
        summary = run_replay(trace, settings, policies, bar)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"knitkit replay: {exc}", file=sys.stderr)
        return 2
    print(format_table(summary))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    if args.plot:
        from knitkit.admission.replay.plot import plot_replay

        plot_replay(summary, args.plot)
    return 0
