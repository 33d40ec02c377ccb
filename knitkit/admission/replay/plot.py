"""Figures of a replay summary: composition and staleness per policy (Figure 10), admission timeline (3(b))."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_replay(summary: dict[str, Any], path: str | Path) -> None:
    """Write a PNG: one composition panel per policy, a staleness panel, and the admission timeline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is the `plot` extra
        raise RuntimeError("--plot needs matplotlib: pip install 'knitkit[plot]'") from exc
    policies = summary["policies"]
    names = list(policies)
    batch = summary["settings"]["train_batch_size"]
    lowers = {q["lower"] / batch for q in summary["settings"]["quotas"].values() if q["lower"]}
    cols = max(2, len(names))
    fig = plt.figure(figsize=(3.2 * cols, 7.5))
    grid = fig.add_gridspec(2, cols)
    for i, name in enumerate(names):
        ax = fig.add_subplot(grid[0, i])
        steps = policies[name]["composition_per_step"]
        for source in summary["settings"]["sources"]:
            ax.plot([c.get(source, 0.0) for c in steps], label=source)
        for ratio in lowers:
            ax.axhline(ratio, color="black", linestyle="--", linewidth=0.8)
        ax.set_title(f"{name} ({policies[name]['violations']} violations)", fontsize=9)
        ax.set_xlabel("step (after warm-up)")
        if i == 0:
            ax.set_ylabel("admitted / train batch")
            ax.legend(fontsize=7)
    ax = fig.add_subplot(grid[1, : cols // 2])
    values = [policies[n]["architectural_staleness"] for n in names]
    ax.bar(names, values, color="tab:blue")
    for x, v in enumerate(values):
        ax.text(x, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("architectural staleness\n(versions)")
    ax.set_title(f"Architectural staleness, {summary['settings']['num_minibatches']} mini-batches")
    ax = fig.add_subplot(grid[1, cols // 2 :])
    step_s = summary["rollout_step_s"]
    shown = [n for n in ("linear", "knittrans", "adaptive") if n in policies] or names[:1]
    for color, name in zip(("tab:red", "tab:blue", "tab:green"), shown, strict=False):
        times = policies[name]["admission_times"]
        for t in range(len(times[0])):
            xs = [row[t] / step_s for row in times]
            ax.scatter(
                xs, [t + 1] * len(xs), s=10, alpha=0.5, color=color, label=None if t else name
            )
    ax.set_xlabel("admission time since rollout-step start\n(x colocated step length)")
    ax.set_ylabel("mini-batch")
    ax.set_title("Admission timeline (Figure 3(b))")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # no axis label cut off at the edge
    plt.close(fig)
