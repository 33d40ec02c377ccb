"""Admission benchmark: architectural staleness per policy on `paper4` (4 and 8 mini-batches),
the reductions of knittrans/adaptive against linear, a rho sweep, regret against the offline
optimum on small windows, and the admission decision cost with 100k pending trajectories.
``--families``: the trace families, and the decision cost and worst single call with
``max_staleness`` at 1k/100k/1M pending. ``--random``: adaptive, knittrans and linear on random
small configurations (2-5 sources, rho 0.8-1.2, atomic GRPO groups). ``--stability``: adaptive
against knittrans on random configurations over 64 train batches and several seeds each (mean and
spread across seeds, and where adaptive loses). Progress goes to stderr, one line per finished
configuration; stdout holds the tables.

    python benchmarks/admission.py [--quick] [--families | --random | --stability] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np
from progress import Progress

from knitkit.admission import POLICY_NAMES, AdmissionController, SourceQuota, build_controller
from knitkit.admission.replay import (
    FAMILIES,
    ReplaySettings,
    SourceProfile,
    Trace,
    family_regret,
    generate_trace,
    preset,
    regret_study,
    run_replay,
)
from knitkit.types import TrajectoryMeta

progress = Progress("admission")


def replay_figures(
    minibatches: int, seeds: list[int], train_batches: int
) -> dict[str, dict[str, float]]:
    """Per policy: staleness and violations averaged over seeds, plus first-mini-batch fraction."""
    chosen = preset("paper4")
    runs = []
    for seed in seeds:
        settings = chosen.settings.with_(
            num_minibatches=minibatches, seed=seed, train_batches=train_batches
        )
        runs.append(run_replay(chosen.trace(settings), settings, POLICY_NAMES)["policies"])
        progress(f"paper4, {minibatches} mini-batches, seed {seed}: done")
    return {
        p: {
            "staleness": float(np.mean([r[p]["architectural_staleness"] for r in runs])),
            "staleness_oldest_token": float(
                np.mean([r[p]["architectural_staleness_start"] for r in runs])
            ),
            "violations": int(sum(r[p]["violations"] for r in runs)),
            "steps": int(sum(r[p]["steps"] for r in runs)),
            "mix_skew": float(np.mean([r[p]["mix_skew"] for r in runs])),
            "first_minibatch_fraction": float(
                np.mean([r[p]["first_minibatch_fraction"] for r in runs])
            ),
        }
        for p in POLICY_NAMES
    }


def rho_sweep(rhos: list[float], train_batches: int) -> dict[float, dict[str, float]]:
    chosen = preset("paper4")
    out = {}
    for rho in rhos:
        settings = chosen.settings.with_(rho=rho, train_batches=train_batches)
        policies = run_replay(
            chosen.trace(settings), settings, ("barrier", "linear", "knittrans", "adaptive")
        )
        out[rho] = {p: v["architectural_staleness"] for p, v in policies["policies"].items()}
        progress(f"rho sweep, rho={rho}: done")
    return out


def family_figures(seeds: list[int], train_batches: int) -> dict[str, float]:
    """Per trace family and policy: staleness (mean over seeds), violations (sum), drift (mean),
    and regret of the guarded policies against the clairvoyant per-batch optimum."""
    figures: dict[str, float] = {}
    for name, family in FAMILIES.items():
        runs = []
        for seed in seeds:
            settings = family.settings.with_(seed=seed, train_batches=train_batches, warmup=4)
            runs.append(run_replay(family.trace(settings), settings)["policies"])
            for p in POLICY_NAMES:
                figures[f"family.{name}.seed{seed}.{p}.staleness"] = runs[-1][p][
                    "architectural_staleness"
                ]
            progress(f"family {name}, seed {seed}: done")
        regret = family_regret(family, ("linear", "knittrans", "adaptive"), windows=len(seeds) * 4)
        for p in POLICY_NAMES:
            key = f"family.{name}.{p}"
            figures[f"{key}.staleness"] = float(
                np.mean([r[p]["architectural_staleness"] for r in runs])
            )
            figures[f"{key}.violations"] = int(sum(r[p]["violations"] for r in runs))
            figures[f"{key}.drift"] = float(np.mean([r[p]["drift"] for r in runs]))
            if p in regret:
                figures[f"{key}.regret"] = regret[p]
    return figures


def backlogged_controller(pending: int, max_staleness: int | None) -> AdmissionController:
    """knittrans with four 24% quotas and ``pending`` fast-source trajectories waiting."""
    sources = ("A", "B", "C", "D")
    ctl = build_controller(
        "knittrans",
        train_batch_size=256,
        num_minibatches=4,
        sources=sources,
        quotas=[SourceQuota(source=s, min_ratio=0.24) for s in sources],
        max_staleness=max_staleness,
    )
    for k in range(pending):
        ctl.report(TrajectoryMeta(f"p{k}", f"p{k}", "A", 0, 100, 0, 0))
    return ctl


def stream(reports: int) -> list[TrajectoryMeta]:
    """Mixed completions of the four sources, round robin."""
    return [TrajectoryMeta(f"r{k}", f"r{k}", "ABCD"[k % 4], 0, 100, 0, 0) for k in range(reports)]


def decision_cost_us(pending: int, reports: int, max_staleness: int | None = None) -> float:
    """Microseconds per reported trajectory (report + admission attempts) with ``pending`` waiting.

    A backlog of ``pending`` fast-source trajectories sits in the pool while a stream of mixed
    reports arrives; every report is followed by admission attempts, as a trainer loop does.
    With ``max_staleness`` every train-batch boundary expires stale units (the bound is loose
    enough that none are: the cost measured is the expiry check, which must not grow with the
    backlog).
    """
    ctl = backlogged_controller(pending, max_staleness)
    return _decision_cost(ctl, pending, reports)


def _decision_cost(ctl: AdmissionController, pending: int, reports: int) -> float:
    metas = stream(reports)
    # The CPU is shared, so time ten equal chunks and keep the fastest (best-of-10); a chunk
    # of >= 2000 reports spans several train-batch boundaries, where expiry runs.
    chunk = max(1, reports // 10)
    best = float("inf")
    for first in range(0, chunk * 10, chunk):
        start = time.perf_counter()
        for meta in metas[first : first + chunk]:
            ctl.report(meta)
            while ctl.next_minibatch() is not None:
                pass
        best = min(best, (time.perf_counter() - start) / chunk)
    if pending >= 10 * reports:  # a small backlog is consumed by the stream; a large one stays
        assert ctl.pending >= pending * 0.9, "the backlog must stay pending"
    return best * 1e6


def worst_calls_ms(ctl: AdmissionController, reports: int) -> dict[str, float]:
    """The slowest single ``report()`` and ``next_minibatch()`` over ``reports`` mixed reports
    (each followed by admission attempts), in milliseconds: ``report`` / ``admit`` in CPU time of
    this thread (what the call itself costs, whatever other tenants of the machine do),
    ``report_wall`` in wall time; calls during which CPython ran a full (generation 2) garbage
    collection are left out of those and the longest collection is ``gc``.

    The old pool rebuilt its version buckets inside one report() once dead entries outnumbered
    live ones, i.e. about once per ``pending`` admitted trajectories (0.9 s at 1M pending); a
    stream longer than the backlog passes that point (see NOTE [ Version buckets without
    rebuilds ] in knitkit/admission/pool.py).
    """
    collections: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started.append(time.perf_counter())
            else:
                collections.append(time.perf_counter() - started.pop())

    worst = dict.fromkeys(("report", "admit", "report_wall"), 0.0)
    cpu, wall = time.thread_time, time.perf_counter
    gc.callbacks.append(on_gc)
    try:
        for k in range(reports):  # built one at a time: a million metas would double the memory
            meta = TrajectoryMeta(f"w{k}", f"w{k}", "ABCD"[k % 4], 0, 100, 0, 0)
            seen = len(collections)
            start, start_wall = cpu(), wall()
            ctl.report(meta)
            took, took_wall = cpu() - start, wall() - start_wall
            if len(collections) == seen:
                worst["report"] = max(worst["report"], took)
                worst["report_wall"] = max(worst["report_wall"], took_wall)
            while True:
                seen = len(collections)
                start = cpu()
                admitted = ctl.next_minibatch()
                if len(collections) == seen:
                    worst["admit"] = max(worst["admit"], cpu() - start)
                if admitted is None:
                    break
    finally:
        gc.callbacks.remove(on_gc)
    return {**{k: v * 1e3 for k, v in worst.items()}, "gc": max(collections, default=0.0) * 1e3}


def random_configuration(seed: int) -> tuple[tuple[SourceProfile, ...], int, ReplaySettings]:
    """A small random workload: 2-5 log-normal sources (medians 5-800 s, sigma 0.05-1.3, caps
    1.5-10x), atomic GRPO groups of 1-16, 1-3 groups per mini-batch, 2, 4 or 8 mini-batches,
    lower bounds of 50-98% of each source's random issue share (whole groups), rho 0.8-1.2,
    oversampling 0-0.6, either issue order and partial-rollout mode, caps of 1 or 2 steps."""
    rng = np.random.default_rng(seed)
    names = "ABCDE"[: int(rng.integers(2, 6))]
    profiles = tuple(
        SourceProfile(
            name=s,
            median_s=float(np.exp(rng.uniform(np.log(5), np.log(800)))),
            sigma=float(rng.uniform(0.05, 1.3)),
            cap_factor=float(rng.uniform(1.5, 10)),
        )
        for s in names
    )
    group = int(rng.choice([1, 2, 4, 8, 16]))
    n = int(rng.choice([2, 4, 8]))
    batch = group * n * int(rng.integers(1, 4))
    shares = rng.dirichlet(np.ones(len(names)) * rng.uniform(0.5, 3))
    tight = rng.uniform(0.5, 0.98)
    quotas = tuple(
        SourceQuota(source=s, min_count=int(tight * share * batch // group * group))
        for s, share in zip(names, shares, strict=True)
    )
    settings = ReplaySettings(
        train_batch_size=batch,
        num_minibatches=n,
        quota_specs=quotas,
        issue_shares={s: float(share) for s, share in zip(names, shares, strict=True)},
        oversample=float(rng.uniform(0.0, 0.6)),
        issue_order=str(rng.choice(["round_robin", "slow_first"])),
        source_cap=float(rng.choice([1.0, 2.0])),
        partial_rollout=str(rng.choice(["drain", "abort_resume"])),
        rollout_slots=max(1, int(batch * rng.uniform(0.3, 1.5))),
        rho=float(rng.uniform(0.8, 1.2)),
        group_atomic=True,
        train_batches=16,
        warmup=4,
        seed=seed,
    )
    return profiles, group, settings


def random_trace(
    seed: int, trace_seed: int | None = None, train_batches: int | None = None
) -> tuple[Trace, ReplaySettings]:
    """Configuration ``seed``'s settings (over ``train_batches``, default its own) and a trace
    long enough for them, drawn with ``trace_seed`` (default ``seed``)."""
    profiles, group, settings = random_configuration(seed)
    if train_batches is not None:
        settings = settings.with_(train_batches=train_batches)
    shares = settings.issue_shares or {}
    per_step = (1 + settings.oversample) * settings.train_batch_size * max(shares.values())
    needed = int(per_step / group * (settings.train_batches + 4) * 2) + 8
    trace = generate_trace(  # 4000 trajectories a source, more where a big batch needs them
        profiles,
        samples_per_source=max(4000 // group + 50, needed),
        group_size=group,
        seed=seed if trace_seed is None else trace_seed,
    )
    return trace, settings


def random_figures(count: int) -> dict[str, float]:
    """adaptive vs knittrans and knittrans vs linear over ``count`` random configurations: how
    often and by how much each is above the other, and whether adaptive ran faster (shorter
    steps) where it was above."""
    rows = []
    skipped = 0
    for seed in range(count):
        trace, settings = random_trace(seed)
        try:
            runs = run_replay(trace, settings, ("linear", "knittrans", "adaptive"))["policies"]
        except RuntimeError:  # a step cannot feed the quotas even with dynamic sampling
            skipped += 1
            continue
        rows.append((seed, settings, runs))
        progress(f"random configuration {seed + 1}/{count}: done")

    def stale(runs: dict, policy: str) -> float:
        return float(runs[policy]["architectural_staleness"])

    worse = [(s, c, r) for s, c, r in rows if stale(r, "adaptive") > stale(r, "knittrans") + 1e-9]
    better = [r for _, _, r in rows if stale(r, "adaptive") < stale(r, "knittrans") - 1e-9]
    lost = [(s, c, r) for s, c, r in rows if stale(r, "knittrans") > stale(r, "linear") + 1e-9]
    figures: dict[str, float] = {
        "random.violations": sum(r[p]["violations"] for _, _, r in rows for p in r),
        "random.configurations": len(rows),
        "random.stalled": skipped,
        "random.adaptive_worse_than_knittrans": len(worse),
        "random.adaptive_worse_max": max(
            (stale(r, "adaptive") / stale(r, "knittrans") - 1 for _, _, r in worse), default=0.0
        ),
        "random.adaptive_worse_and_faster": sum(
            r["adaptive"]["seconds_per_step"] < r["knittrans"]["seconds_per_step"] - 1e-9
            for _, _, r in worse
        ),
        "random.adaptive_worse_drain": sum(c.partial_rollout == "drain" for _, c, _ in worse),
        "random.drain": sum(c.partial_rollout == "drain" for _, c, _ in rows),
        "random.adaptive_better_than_knittrans": len(better),
        "random.adaptive_better_mean": float(
            np.mean([1 - stale(r, "adaptive") / stale(r, "knittrans") for r in better])
        )
        if better
        else 0.0,
        "random.knittrans_worse_than_linear": len(lost),
        "random.knittrans_worse_than_linear_max": max(
            (stale(r, "knittrans") / stale(r, "linear") - 1 for _, _, r in lost), default=0.0
        ),
        "random.knittrans_worse_than_linear_rho_ge_1": sum(c.rho >= 1 for _, c, _ in lost),
        "random.rho_ge_1": sum(c.rho >= 1 for _, c, _ in rows),
        "random.knittrans_worse_than_linear_drain": sum(
            c.partial_rollout == "drain" for _, c, _ in lost
        ),
    }
    for seed, config, runs in worse:
        key = f"random.adaptive_worse.seed{seed}"
        figures[key] = stale(runs, "adaptive") / stale(runs, "knittrans") - 1
        figures[f"{key}.rho"] = config.rho
        figures[f"{key}.num_minibatches"] = config.num_minibatches
        figures[f"{key}.drain"] = float(config.partial_rollout == "drain")
        figures[f"{key}.step_ratio"] = (
            runs["adaptive"]["seconds_per_step"] / runs["knittrans"]["seconds_per_step"]
        )
    return figures


STABLE_TRAIN_BATCHES = 64
"""Train batches per replay of ``--stability`` (the random study's 16 were too few to be stable)."""


def stability_figures(configurations: list[int], seeds: int) -> dict[str, float]:
    """adaptive against knittrans (relative staleness, ``adaptive / knittrans - 1``) on the
    random study's ``configurations``, each replayed over STABLE_TRAIN_BATCHES train batches with ``seeds``
    trace and replay seeds: the mean over configurations of each one's mean over seeds, the
    spread across seeds (per configuration, then the mean and the largest), and the same split
    by mini-batches per train batch and by the colocated reference's staleness (below 0.5 or
    not)."""
    rows: list[tuple[int, ReplaySettings, float, list[float]]] = []
    skipped = 0
    for done, seed in enumerate(configurations, start=1):
        ratios, colocated = [], []
        for k in range(seeds):
            trace, base = random_trace(seed, 1000 * seed + k, STABLE_TRAIN_BATCHES)
            settings = base.with_(seed=1000 * seed + k)
            try:
                summary = run_replay(trace, settings, ("knittrans", "adaptive"))
            except RuntimeError:  # a step cannot feed the quotas even with dynamic sampling
                break
            runs = summary["policies"]
            knit = runs["knittrans"]["architectural_staleness"]
            ratios.append(runs["adaptive"]["architectural_staleness"] / knit - 1 if knit else 0.0)
            colocated.append(summary["colocated_staleness"])
        if len(ratios) < seeds:
            skipped += 1
            continue
        rows.append((seed, base, float(np.mean(colocated)), ratios))
        progress(f"stability configuration {seed} ({done}/{len(configurations)}): done")
    figures: dict[str, float] = {
        "stability.configurations": len(rows),
        "stability.stalled": skipped,
        "stability.seeds": seeds,
        "stability.train_batches": STABLE_TRAIN_BATCHES,
    }

    def summarise(key: str, chosen: list[tuple[int, ReplaySettings, float, list[float]]]) -> None:
        means = [float(np.mean(r)) for _, _, _, r in chosen]
        spreads = [float(np.std(r)) for _, _, _, r in chosen]
        figures[f"{key}.configurations"] = len(chosen)
        figures[f"{key}.mean"] = float(np.mean(means)) if means else 0.0
        figures[f"{key}.median"] = float(np.median(means)) if means else 0.0
        figures[f"{key}.max"] = max(means, default=0.0)
        figures[f"{key}.min"] = min(means, default=0.0)
        figures[f"{key}.seed_spread_mean"] = float(np.mean(spreads)) if spreads else 0.0
        figures[f"{key}.seed_spread_max"] = max(spreads, default=0.0)
        figures[f"{key}.single_seed_max"] = max((max(r) for *_, r in chosen), default=0.0)
        figures[f"{key}.adaptive_worse"] = sum(m > 1e-9 for m in means)
        figures[f"{key}.adaptive_worse_by_5pct"] = sum(m > 0.05 for m in means)

    summarise("stability", rows)
    for n in (2, 4, 8):
        summarise(f"stability.mb{n}", [r for r in rows if r[1].num_minibatches == n])
    summarise("stability.colocated_lt_0.5", [r for r in rows if r[2] < 0.5])
    summarise("stability.colocated_ge_0.5", [r for r in rows if r[2] >= 0.5])
    summarise("stability.drain", [r for r in rows if r[1].partial_rollout == "drain"])
    summarise("stability.rho_ge_1", [r for r in rows if r[1].rho >= 1])
    for seed, settings, colocated, ratios in rows:
        key = f"stability.seed{seed}"
        figures[key] = float(np.mean(ratios))
        figures[f"{key}.spread"] = float(np.std(ratios))
        figures[f"{key}.num_minibatches"] = settings.num_minibatches
        figures[f"{key}.colocated_staleness"] = colocated
        figures[f"{key}.rho"] = settings.rho
        figures[f"{key}.drain"] = float(settings.partial_rollout == "drain")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer seeds and train batches (< 1 min)"
    )
    parser.add_argument("--json", default=None, help="write the flat figure object here")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--families",
        action="store_true",
        help="sweep the trace families and time max_staleness at 1k/100k/1M pending instead",
    )
    mode.add_argument(
        "--random",
        action="store_true",
        help="compare adaptive, knittrans and linear on random small configurations instead",
    )
    mode.add_argument(
        "--stability",
        action="store_true",
        help=f"adaptive vs knittrans on random configurations over {STABLE_TRAIN_BATCHES} train "
        "batches and 3 seeds each (mean and spread) instead",
    )
    args = parser.parse_args()
    if args.stability:
        stability_main(args)
        return
    if args.families:
        families_main(args)
        return
    if args.random:
        random_main(args)
        return
    seeds = [0] if args.quick else [0, 1, 2]
    batches = 24 if args.quick else 40
    figures: dict[str, float] = {"rho": preset("paper4").settings.rho}
    print(f"paper4 replay, seeds {seeds}, {batches} train batches, rho={figures['rho']}")
    for n in (4, 8):
        per_policy = replay_figures(n, seeds, batches)
        print(f"\n{n} mini-batches per train batch")
        print(
            f"{'policy':<10} {'staleness':>9} {'(oldest)':>9} {'violations':>10} {'/steps':>6} {'mix skew':>8}"
        )
        for p, v in per_policy.items():
            figures[f"mb{n}.{p}.staleness"] = v["staleness"]
            figures[f"mb{n}.{p}.violations"] = v["violations"]
            figures[f"mb{n}.{p}.mix_skew"] = v["mix_skew"]
            print(
                f"{p:<10} {v['staleness']:>9.3f} {v['staleness_oldest_token']:>9.3f} "
                f"{v['violations']:>10d} {v['steps']:>6d} {v['mix_skew']:>8.3f}"
            )
        linear = per_policy["linear"]["staleness"]
        for p in ("knittrans", "adaptive"):
            figures[f"mb{n}.{p}.reduction_vs_linear"] = 1.0 - per_policy[p]["staleness"] / linear
        figures[f"mb{n}.linear.first_minibatch_fraction"] = per_policy["linear"][
            "first_minibatch_fraction"
        ]
        print(
            f"reduction vs linear: knittrans {figures[f'mb{n}.knittrans.reduction_vs_linear']:.1%}, "
            f"adaptive {figures[f'mb{n}.adaptive.reduction_vs_linear']:.1%}; linear first mini-batch "
            f"at {figures[f'mb{n}.linear.first_minibatch_fraction']:.2f} of the rollout step"
        )
    rhos = [0.5, 0.85, 1.1] if args.quick else [0.25, 0.5, 0.7, 0.85, 1.0, 1.1, 1.3]
    print("\nrho sweep (4 mini-batches): architectural staleness")
    print(
        f"{'rho':>5} {'barrier':>8} {'linear':>8} {'knittrans':>9} {'adaptive':>8} {'knit vs lin':>11}"
    )
    for rho, row in rho_sweep(rhos, 24 if args.quick else 32).items():
        cut = 1.0 - row["knittrans"] / row["linear"] if row["linear"] > 0 else 0.0
        figures[f"rho{rho}.knittrans.reduction_vs_linear"] = cut
        for name, value in row.items():
            figures[f"rho{rho}.{name}.staleness"] = value
        print(
            f"{rho:>5.2f} {row['barrier']:>8.3f} {row['linear']:>8.3f} {row['knittrans']:>9.3f} {row['adaptive']:>8.3f} {cut:>11.1%}"
        )
    regret = regret_study(("linear", "knittrans", "adaptive"), windows=6 if args.quick else 20)
    print("\nregret vs clairvoyant per-batch optimum (relative sync-time excess, small windows):")
    for name, value in regret.items():
        figures[f"regret.{name}"] = value
        print(f"  {name:<10} {value:.3%}")
    cost = decision_cost_us(100_000, 5_000 if args.quick else 20_000)
    progress("decision cost at 100k pending: done")
    figures["decision_cost_us"] = cost
    print(
        f"\ndecision cost with 100k pending: {cost:.1f} us per reported trajectory (target <= 50)"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1, sort_keys=True)


def families_main(args: argparse.Namespace) -> None:
    seeds = [0, 1] if args.quick else [0, 1, 2]
    batches = 16 if args.quick else 30
    figures = family_figures(seeds, batches)
    print(f"trace families, seeds {seeds}, {batches} train batches (4 mini-batches)")
    print(
        f"{'family':<22} {'policy':<10} {'staleness':>9} {'violations':>10} {'drift':>6} {'regret':>7}"
    )
    for name in FAMILIES:
        for p in POLICY_NAMES:
            key = f"family.{name}.{p}"
            regret = figures.get(f"{key}.regret")
            print(
                f"{name:<22} {p:<10} {figures[key + '.staleness']:>9.3f} "
                f"{figures[key + '.violations']:>10d} {figures[key + '.drift']:>6.2f} "
                + (f"{regret:>7.2%}" if regret is not None else f"{'-':>7}")
            )
        worse = [
            s
            for s in seeds
            if figures[f"family.{name}.seed{s}.adaptive.staleness"]
            > figures[f"family.{name}.seed{s}.knittrans.staleness"]
        ]
        print(f"{'':<22} adaptive worse than knittrans on seeds: {worse or 'none'}")
    print(
        "\ndecision cost with max_staleness on (us per reported trajectory), and the slowest"
        "\nsingle report() / next_minibatch() (ms) over a stream longer than the backlog"
        "\n(calls that contained a full garbage collection counted apart):"
    )
    reports = 5_000 if args.quick else 20_000
    for pending in (1000, 100_000, 1_000_000):
        ctl = backlogged_controller(pending, max_staleness=10_000)
        cost = _decision_cost(ctl, pending, reports)
        worst = worst_calls_ms(ctl, reports if args.quick else max(reports, pending + 10_000))
        del ctl
        figures[f"decision_cost_us.max_staleness.{pending}"] = cost
        for name, value in worst.items():
            figures[f"{name}_worst_ms.{pending}"] = value
        progress(f"decision cost and worst calls at {pending} pending: done")
        print(
            f"  {pending:>9} pending: {cost:8.1f} us (target <= 20 at 1M); worst report() "
            f"{worst['report']:7.2f} ms CPU ({worst['report_wall']:7.2f} wall), worst "
            f"next_minibatch() {worst['admit']:7.2f} ms CPU; longest full gc {worst['gc']:7.1f} ms"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1, sort_keys=True)


def random_main(args: argparse.Namespace) -> None:
    count = 40 if args.quick else 300
    f = random_figures(count)
    print(
        f"random configurations: {f['random.configurations']:.0f} replayed, "
        f"{f['random.stalled']:.0f} could not be fed (2-5 sources, rho 0.8-1.2, atomic groups); "
        f"{f['random.violations']:.0f} train batches missing a quota"
    )
    print(
        f"  adaptive above knittrans in {f['random.adaptive_worse_than_knittrans']:.0f} "
        f"(at most {f['random.adaptive_worse_max']:.1%} above; "
        f"{f['random.adaptive_worse_and_faster']:.0f} of them with shorter steps, "
        f"{f['random.adaptive_worse_drain']:.0f} in drain mode, which "
        f"{f['random.drain']:.0f} configurations use), below in "
        f"{f['random.adaptive_better_than_knittrans']:.0f} (mean "
        f"{f['random.adaptive_better_mean']:.1%} below), equal in the rest"
    )
    for key in sorted(
        k for k in f if k.startswith("random.adaptive_worse.seed") and k.count(".") == 2
    ):
        print(
            f"    seed {key.rsplit('seed', 1)[1]}: {f[key]:+.1%}, rho {f[key + '.rho']:.2f}, "
            f"{f[key + '.num_minibatches']:.0f} mini-batches, "
            f"{'drain' if f[key + '.drain'] else 'abort_resume'}, "
            f"step time x{f[key + '.step_ratio']:.2f}"
        )
    print(
        f"  knittrans above linear in {f['random.knittrans_worse_than_linear']:.0f} "
        f"(at most {f['random.knittrans_worse_than_linear_max']:.1%} above; "
        f"{f['random.knittrans_worse_than_linear_rho_ge_1']:.0f} at rho >= 1, which "
        f"{f['random.rho_ge_1']:.0f} configurations have; "
        f"{f['random.knittrans_worse_than_linear_drain']:.0f} in drain mode)"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(f, out, indent=1, sort_keys=True)


def stability_main(args: argparse.Namespace) -> None:
    # The random study's first configurations, and 206: its largest loss at 16 train batches.
    configurations, seeds = ([*range(12), 206], 2) if args.quick else ([*range(100), 206], 3)
    f = stability_figures(configurations, seeds)
    print(
        f"adaptive vs knittrans, {f['stability.configurations']:.0f} random configurations "
        f"({f['stability.stalled']:.0f} could not be fed), {seeds} seeds each, "
        f"{STABLE_TRAIN_BATCHES} train batches: staleness of adaptive relative to knittrans"
    )
    print(
        f"{'configurations':<26} {'n':>3} {'mean':>7} {'median':>7} {'min':>7} {'max':>7} "
        f"{'seed spread':>11} {'(max)':>7} {'worse':>5} {'>5%':>4}"
    )
    for key, label in (
        ("stability", "all"),
        ("stability.mb2", "2 mini-batches"),
        ("stability.mb4", "4 mini-batches"),
        ("stability.mb8", "8 mini-batches"),
        ("stability.colocated_lt_0.5", "colocated staleness < 0.5"),
        ("stability.colocated_ge_0.5", "colocated staleness >= 0.5"),
        ("stability.drain", "drain"),
        ("stability.rho_ge_1", "rho >= 1"),
    ):
        print(
            f"{label:<26} {f[key + '.configurations']:>3.0f} {f[key + '.mean']:>+7.1%} "
            f"{f[key + '.median']:>+7.1%} {f[key + '.min']:>+7.1%} {f[key + '.max']:>+7.1%} "
            f"{f[key + '.seed_spread_mean']:>11.1%} {f[key + '.seed_spread_max']:>7.1%} "
            f"{f[key + '.adaptive_worse']:>5.0f} {f[key + '.adaptive_worse_by_5pct']:>4.0f}"
        )
    print(
        f"largest single-seed gap: {f['stability.single_seed_max']:+.1%}; configurations where "
        "adaptive is above knittrans (mean over seeds), and 206:"
    )
    for seed in configurations:
        key = f"stability.seed{seed}"
        if key in f and (f[key] > 1e-9 or seed == 206):
            print(
                f"    configuration {seed}: {f[key]:+.1%} +- {f[key + '.spread']:.1%} "
                f"(std over seeds), {f[key + '.num_minibatches']:.0f} mini-batches, colocated "
                f"staleness {f[key + '.colocated_staleness']:.2f}, rho {f[key + '.rho']:.2f}, "
                f"{'drain' if f[key + '.drain'] else 'abort_resume'}"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(f, out, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
