"""Replay a rollout trace under admission policies; print architectural staleness and quota violations."""

from __future__ import annotations

import argparse
import csv
import json
import sys

from knitkit.admission import checks
from knitkit.admission.policies import POLICY_NAMES, describe
from knitkit.admission.predicates import SourceQuota
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
    parser.add_argument(
        "--train-batch-size", type=int, default=None, help="trajectories per train batch"
    )
    parser.add_argument(
        "--train-batches",
        default=None,
        help="train batches to replay, or 'auto' (as many as the trace allows)",
    )
    parser.add_argument(
        "--rho", type=float, default=None, help="training time / rollout-step length"
    )
    parser.add_argument("--seed", type=int, default=None, help="trace seed (presets only)")
    parser.add_argument(
        "--quotas", default=None, help="lower-bound ratios for --trace, e.g. A=0.24,B=0.24"
    )
    parser.add_argument(
        "--quotas-file",
        default=None,
        help='JSON: {"quotas": {SOURCE: {"min_ratio"|"min_count", "max_ratio"|"max_count", '
        '"group"}}, "completion_quota": RATIO}',
    )
    parser.add_argument("--issue-shares", default=None, help="issue share per source, A=0.5,B=0.5")
    parser.add_argument("--oversample", type=float, default=None, help="extra issue per step")
    parser.add_argument("--slots", type=int, default=None, help="concurrent rollout slots")
    parser.add_argument(
        "--source-cap",
        type=float,
        default=None,
        help="per-source outstanding cap (x step issue; binds below 1)",
    )
    parser.add_argument(
        "--max-staleness", type=int, default=None, help="drop trajectories older than this"
    )
    parser.add_argument(
        "--dynamic-sampling-rounds",
        type=int,
        default=None,
        help="extra issue rounds a rollout step may add when rejected groups leave its train "
        "batch short (DAPO dynamic sampling; 0: off)",
    )
    parser.add_argument("--json", dest="json_out", default=None, help="write the summary here")
    parser.add_argument("--csv", dest="csv_out", default=None, help="write one row per policy")
    parser.add_argument("--plot", default=None, help="write a PNG figure here")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


_FLAG_CHECKS: tuple[tuple[str, str, str], ...] = (
    ("minibatches", "--minibatches", "count>=1"),
    ("train_batch_size", "--train-batch-size", "count>=1"),
    ("slots", "--slots", "count>=1"),
    ("max_staleness", "--max-staleness", "count>=0"),
    ("seed", "--seed", "count>=0"),
    ("dynamic_sampling_rounds", "--dynamic-sampling-rounds", "count>=0"),
    ("rho", "--rho", "number>0"),
    ("source_cap", "--source-cap", "number>0"),
    ("oversample", "--oversample", "number>=0"),
)
"""Numeric flags: (argument, flag, kind); a bad value is refused naming the flag."""


def _check_flags(args: argparse.Namespace) -> None:
    for attr, flag, kind in _FLAG_CHECKS:
        value = getattr(args, attr)
        if value is None:
            continue
        if kind.startswith("count"):
            checks.whole(value, flag, minimum=int(kind[-1]))
        else:
            checks.finite(value, flag, positive=kind == "number>0")


def policy_list(text: str) -> list[str]:
    """The policies of ``--policies``; refuses an empty list naming the flag."""
    policies = [p.strip() for p in text.split(",") if p.strip()]
    if not policies:
        raise ValueError(
            f"--policies {text!r} names no policy; choose from {', '.join(POLICY_NAMES)}"
        )
    return policies


def _conflicts(args: argparse.Namespace) -> None:
    if args.quotas and args.quotas_file:
        raise ValueError("--quotas and --quotas-file both give quotas; use one")
    if args.trace is None and (args.quotas or args.quotas_file):
        raise ValueError("--quotas/--quotas-file apply to --trace; a preset has its own quotas")
    if args.trace is not None and args.seed is not None:
        raise ValueError("--seed draws a preset's trace; a --trace file is replayed as it is")


def _load(args: argparse.Namespace) -> tuple[Trace, ReplaySettings]:
    _conflicts(args)
    _check_flags(args)
    changes: dict[str, object] = {"num_minibatches": args.minibatches}
    for flag, name in (
        ("train_batch_size", "train_batch_size"),
        ("rho", "rho"),
        ("oversample", "oversample"),
        ("slots", "rollout_slots"),
        ("source_cap", "source_cap"),
        ("max_staleness", "max_staleness"),
        ("dynamic_sampling_rounds", "dynamic_sampling_rounds"),
    ):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    shares = (
        _parse_pairs(args.issue_shares, "--issue-shares", "math=0.5", ratio=False)
        if args.issue_shares
        else {}
    )
    if shares:
        changes["issue_shares"] = shares
    if args.trace is None:
        chosen = preset(args.preset)
        _check_shares(shares, [p.name for p in chosen.profiles])
        if args.seed is not None:
            changes["seed"] = args.seed
        settings = _with_batches(chosen.settings.with_(**changes), args.train_batches, None)
        return chosen.trace(settings), settings
    trace = read_jsonl(args.trace)
    _check_shares(shares, list(trace.sources))
    if args.quotas_file:
        changes.update(read_quotas_file(args.quotas_file))
    elif args.quotas:
        changes["quota_ratios"] = _parse_pairs(args.quotas, "--quotas", "math=0.45", ratio=True)
    else:
        changes["quota_ratios"] = dict.fromkeys(trace.sources, 0.96 / len(trace.sources))
    settings = ReplaySettings(**changes)  # type: ignore[arg-type]
    return trace, _with_batches(settings, args.train_batches, trace)


def _check_shares(shares: dict[str, float], sources: list[str]) -> None:
    unknown = set(shares) - set(sources)
    if unknown:
        raise ValueError(
            f"--issue-shares names {sorted(unknown)}, not in the trace; sources: {tuple(sources)}"
        )


def _with_batches(
    settings: ReplaySettings, text: str | None, trace: Trace | None
) -> ReplaySettings:
    if text is None:
        return settings
    if text == "auto":
        if trace is None:
            raise ValueError("--train-batches auto needs --trace (a preset draws any length)")
        count = auto_train_batches(trace, settings)
    else:
        try:
            count = int(text)
        except ValueError:
            raise ValueError(f"--train-batches {text!r}: give a whole number or 'auto'") from None
        if count < 2:
            raise ValueError(
                f"--train-batches {count}: give at least 2 (a warm-up batch and a measured one)"
            )
    return settings.with_(train_batches=count, warmup=max(1, min(6, count // 4)))


def auto_train_batches(trace: Trace, settings: ReplaySettings) -> int:
    """As many train batches as every source's records can feed (each step issues a full share)."""
    shares = settings.issue_shares or dict.fromkeys(trace.sources, 1.0 / len(trace.sources))
    per_step = {
        s: (1 + settings.oversample) * settings.train_batch_size * shares.get(s, 0.0)
        for s in trace.sources
    }
    fits = {
        s: int(len(trace.records[s]) / per_step[s]) - 2 for s in trace.sources if per_step[s] > 0
    }
    source = min(fits, key=fits.__getitem__)
    if fits[source] < 3:
        raise ValueError(
            f"trace too short: source {source!r} has {len(trace.records[source])} records, "
            f"{per_step[source]:.0f} issued per rollout step; --train-batches auto needs at least "
            f"{int(5 * per_step[source])}: add records or lower --train-batch-size/--oversample"
        )
    return fits[source]


def read_quotas_file(path: str) -> dict[str, object]:
    """``ReplaySettings`` fields from a quotas JSON file (see ``--quotas-file``)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("quotas", {}), dict):
        raise ValueError(f'{path}: expected {{"quotas": {{SOURCE: {{...}}}}, ...}}')
    unknown = set(data) - {"quotas", "completion_quota"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; use quotas, completion_quota")
    specs = []
    for source, fields in data.get("quotas", {}).items():
        where = f"{path}: quota {source!r}"
        if not isinstance(fields, dict) or set(fields) - _QUOTA_FIELDS.keys():
            raise ValueError(f"{where}: give an object with fields {', '.join(_QUOTA_FIELDS)}")
        for name, value in fields.items():
            if isinstance(value, bool) or not isinstance(value, _QUOTA_FIELDS[name]):
                raise ValueError(f"{where}: {name}={value!r} has the wrong type")
        try:
            specs.append(SourceQuota(source=source, **fields))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    out: dict[str, object] = {"quota_specs": tuple(specs)}
    completion = data.get("completion_quota")
    if completion is not None:
        if isinstance(completion, bool) or not isinstance(completion, int | float):
            raise ValueError(f"{path}: completion_quota={completion!r}: give a ratio in [0, 1]")
        out["completion_quota"] = float(completion)
    return out


_QUOTA_FIELDS: dict[str, type | tuple[type, ...]] = {
    "min_ratio": (int, float),
    "min_count": int,
    "max_ratio": (int, float),
    "max_count": int,
    "group": str,
}
"""What a quota of ``--quotas-file`` may hold, with the JSON types each field takes."""


def _parse_pairs(text: str, flag: str, example: str, *, ratio: bool) -> dict[str, float]:
    """``SOURCE=VALUE,...`` with finite values (in [0, 1] if ``ratio``), refused naming ``flag``."""
    values = {}
    for item in text.split(","):
        source, sep, value = item.partition("=")
        try:
            values[source.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not source.strip():
            raise ValueError(f"{flag} item {item!r}: expected SOURCE=RATIO, e.g. {example}")
        name = f"{flag} {source.strip()}"
        if ratio:
            checks.ratio(values[source.strip()], name)
        else:
            checks.finite(values[source.strip()], name)
    return values


def format_table(summary: Summary) -> str:
    """A fixed-width table of the per-policy figures."""
    sources = summary["settings"]["sources"]
    head = f"{'policy':<10} {'arch.stale':>10} {'(oldest)':>9} {'drift':>6} {'violations':>10} {'steps':>5} {'mix skew':>8} {'1st-MB frac':>11} {'idle':>5}"
    head += "".join(f" {s[:8]:>8}" for s in sources)
    lines = [head, "-" * len(head)]
    for name, p in summary["policies"].items():
        lines.append(
            f"{name:<10} {p['architectural_staleness']:>10.3f} {p['architectural_staleness_start']:>9.3f} "
            f"{p['drift']:>6.2f} {p['violations']:>10d} {p['steps']:>5d} {p['mix_skew']:>8.3f} "
            f"{p['first_minibatch_fraction']:>11.2f} {p['trainer_idle_fraction']:>5.2f}"
            + "".join(f" {p['staleness_per_source'].get(s, float('nan')):>8.3f}" for s in sources)
        )
    lines.append("(per-source columns: architectural staleness of that source's tokens)")
    lines.append(
        f"rho={summary['rho']:.2f}  rollout step={summary['rollout_step_s']:.0f} s  "
        f"colocated staleness={summary['colocated_staleness']:.3f}"
    )
    return "\n".join(lines)


def write_csv(summary: Summary, path: str) -> None:
    """One row per policy: the headline figures and per-source staleness."""
    sources = summary["settings"]["sources"]
    keys = (
        "architectural_staleness",
        "architectural_staleness_start",
        "drift",
        "violations",
        "steps",
        "mix_skew",
        "first_minibatch_fraction",
        "trainer_idle_fraction",
    )
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["policy", *keys, *(f"staleness.{s}" for s in sources)])
        for name, p in summary["policies"].items():
            per_source = p["staleness_per_source"]
            writer.writerow([name, *(p[k] for k in keys), *(per_source.get(s) for s in sources)])


def run(args: argparse.Namespace) -> int:
    try:
        policies = policy_list(args.policies)
        trace, settings = _load(args)
        bar = (
            None
            if args.quiet
            else ProgressBar(settings.train_batches * (len(policies) + 1), "replay")
        )
        summary = run_replay(trace, settings, policies, bar)
        summary["settings"]["trace"] = args.trace
        summary["settings"]["preset"] = None if args.trace else args.preset
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"knitkit replay: {exc}", file=sys.stderr)
        return 2
    print(format_table(summary))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    if args.csv_out:
        write_csv(summary, args.csv_out)
    if args.plot:
        from knitkit.admission.replay.plot import plot_replay

        plot_replay(summary, args.plot)
    return 0
