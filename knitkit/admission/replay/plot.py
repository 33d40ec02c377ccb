"""Figures of a replay summary: what differs per policy (staleness, admission times), composition, Figure 3(b)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

COLORS = {
    "barrier": "tab:gray",
    "linear": "tab:red",
    "knittrans": "tab:blue",
    "adaptive": "tab:green",
}


def plot_replay(summary: dict[str, Any], path: str | Path) -> None:
    """Write ``replay_figure(summary)`` as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is the `plot` extra
        raise RuntimeError("--plot needs matplotlib: pip install 'knitkit[plot]'") from exc
    fig = replay_figure(summary)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # no axis label cut off at the edge
    plt.close(fig)


def replay_figure(summary: dict[str, Any]) -> Figure:
    """Five panels, every policy in each: staleness per step, mean admission time per mini-batch,
    train-batch composition, mean staleness, and the admission timeline (Figure 3(b)).

    NOTE [ Replay panels compare policies ]: a panel per policy repeats whatever the policies
    share: under quotas every policy fills each train batch to the same composition, so four
    composition panels were four copies. Each panel here puts every policy on one axis, on what
    tells them apart (when each mini-batch is admitted, the staleness that follows); the
    composition is drawn once when it is the same for every policy, and per policy otherwise.
    """
    import matplotlib.pyplot as plt

    policies = summary["policies"]
    fig = plt.figure(figsize=(15, 8))
    grid = fig.add_gridspec(2, 6)
    _staleness_per_step(fig.add_subplot(grid[0, 0:2]), policies)
    _admission_per_minibatch(fig.add_subplot(grid[0, 2:4]), policies, summary["rollout_step_s"])
    _composition(fig.add_subplot(grid[0, 4:6]), summary)
    _staleness_bars(fig.add_subplot(grid[1, 0:3]), summary)
    _timeline(fig.add_subplot(grid[1, 3:6]), policies, summary["rollout_step_s"])
    fig.tight_layout()
    return fig


def _color(name: str) -> str | None:
    return COLORS.get(name)


def _staleness_per_step(ax: Axes, policies: dict[str, Any]) -> None:
    for name, figures in policies.items():
        ax.plot(figures["staleness_per_step"], marker=".", label=name, color=_color(name))
    ax.set(
        title="Architectural staleness per train batch",
        xlabel="train batch (after warm-up)",
        ylabel="staleness (versions)",
    )
    ax.legend(fontsize=7)


def _admission_per_minibatch(ax: Axes, policies: dict[str, Any], step_s: float) -> None:
    """Mean admission time of each mini-batch index over the steps, with its min-max range."""
    for name, figures in policies.items():
        times = figures["admission_times"]
        columns = [[row[t] / step_s for row in times] for t in range(len(times[0]))]
        means = [sum(c) / len(c) for c in columns]
        below = [m - min(c) for m, c in zip(means, columns, strict=True)]
        above = [max(c) - m for m, c in zip(means, columns, strict=True)]
        xs = range(1, len(means) + 1)
        ax.errorbar(
            xs, means, yerr=[below, above], marker="o", capsize=3, label=name, color=_color(name)
        )
    ax.set_xticks(range(1, len(next(iter(policies.values()))["admission_times"][0]) + 1))
    ax.set(
        title="When each mini-batch is admitted (mean, min-max)",
        xlabel="mini-batch of the train batch",
        ylabel="time since rollout-step start\n(x colocated step length)",
    )
    ax.legend(fontsize=7)


def _composition(ax: Axes, summary: dict[str, Any]) -> None:
    """Each source's share of every train batch: once when every policy's is the same, per
    policy otherwise (see NOTE [ Replay panels compare policies ])."""
    policies = summary["policies"]
    sources = summary["settings"]["sources"]
    batch = summary["settings"]["train_batch_size"]
    compositions = {name: figures["composition_per_step"] for name, figures in policies.items()}
    shared = len({repr(c) for c in compositions.values()}) == 1
    shown = dict(list(compositions.items())[:1]) if shared else compositions
    styles = ("-", "--", ":", "-.")
    for index, (name, steps) in enumerate(shown.items()):
        style = styles[index % len(styles)]
        for source in sources:
            label = source if shared else f"{name}: {source}"
            ax.plot([c.get(source, 0.0) for c in steps], linestyle=style, label=label)
    for ratio in {q["lower"] / batch for q in summary["settings"]["quotas"].values() if q["lower"]}:
        ax.axhline(ratio, color="black", linestyle="--", linewidth=0.8)
    violations = ", ".join(f"{n} {f['violations']}" for n, f in policies.items())
    which = f"the same under all {len(policies)} policies" if shared else "per policy"
    ax.set(
        title=f"Train-batch composition, {which}\n(violations: {violations})",
        xlabel="train batch (after warm-up)",
        ylabel="admitted / train batch",
    )
    ax.legend(fontsize=7, ncol=2 if shared else 1)


def _staleness_bars(ax: Axes, summary: dict[str, Any]) -> None:
    policies = summary["policies"]
    names = list(policies)
    values = [policies[n]["architectural_staleness"] for n in names]
    ax.bar(names, values, color=[_color(n) or "tab:blue" for n in names])
    for x, v in enumerate(values):
        ax.text(x, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("architectural staleness\n(versions)")
    ax.set_title(
        f"Mean architectural staleness, {summary['settings']['num_minibatches']} mini-batches"
    )


def _timeline(ax: Axes, policies: dict[str, Any], step_s: float) -> None:
    shown = [n for n in ("linear", "knittrans", "adaptive") if n in policies] or list(policies)[:1]
    for name in shown:
        times = policies[name]["admission_times"]
        for t in range(len(times[0])):
            xs = [row[t] / step_s for row in times]
            ax.scatter(
                xs,
                [t + 1] * len(xs),
                s=10,
                alpha=0.5,
                color=_color(name),
                label=None if t else name,
            )
    ax.set_yticks(range(1, len(policies[shown[0]]["admission_times"][0]) + 1))
    ax.set_xlabel("admission time since rollout-step start\n(x colocated step length)")
    ax.set_ylabel("mini-batch")
    ax.set_title("Admission timeline (Figure 3(b))")
    ax.legend(fontsize=7)
