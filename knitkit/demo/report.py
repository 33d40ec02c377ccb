"""The demo's report: a printed table per stage and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from knitkit.demo.pipeline import AdmissionRecord, PipelineResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def summarize(replay: dict[str, Any], live: PipelineResult) -> dict[str, Any]:
    """Flat figures of the whole run (also written as JSON)."""
    steps = live.steps
    last = steps[-1] if steps else {}

    def total(name: str) -> float:
        return float(sum(step.get(name, 0.0) for step in steps))

    micro = last.get("knitkit/delivery/micro_batches", 0.0)
    dedup_s, dup_s = total("knitkit/demo/dedup_encoder_s"), total("knitkit/demo/dup_encoder_s")
    out: dict[str, Any] = {
        f"replay.{name}.{key}": figures[key]
        for name, figures in replay["policies"].items()
        for key in ("architectural_staleness", "violations", "first_minibatch_fraction")
    }
    out["replay.rho"] = replay["rho"]
    for name, record in live.admission.items():
        out[f"live.{name}.first_minibatch_fraction"] = _first_fraction(record)
        complete = _complete_train_batches(record, live.num_minibatches)
        out[f"live.{name}.train_batches_meeting_quotas"] = _quota_ok(record, live.quotas, complete)
        out[f"live.{name}.train_batches"] = len(complete)
    consumed = live.bytes.consumed
    out.update(
        {
            "bytes.knitkit_read": live.knitkit_bytes_read,
            "bytes.consumed": consumed,
            "bytes.sample_level_read": live.bytes.sample_level,
            "bytes.knitkit_ratio": live.knitkit_bytes_read / max(1, consumed),
            "bytes.sample_level_ratio": live.bytes.sample_level / max(1, consumed),
            "prefetch.exposed_wait_ms_per_micro": 1e3
            * last.get("knitkit/delivery/exposed_wait_s", 0.0)
            / max(1.0, micro),
            "prefetch.stage_ms_per_micro": 1e3
            * last.get("knitkit/delivery/stage_s", 0.0)
            / max(1.0, micro),
            "encoder.dup_s": dup_s,
            "encoder.dedup_s": dedup_s,
            "encoder.time_ratio": dup_s / dedup_s if dedup_s else float("nan"),
            "encoder.dup_units": int(total("knitkit/demo/dup_units")),
            "encoder.dedup_units": int(total("knitkit/demo/dedup_units")),
            "passes.written_back_bytes": last.get("knitkit/job/write_back_bytes", 0.0),
            "loss": [step["knitkit/demo/loss"] for step in steps],
            "units_left_in_store": live.units_left,
            "live.wall_s": live.wall_s,
        }
    )
    return out


def print_report(figures: dict[str, Any], replay_policies: list[str]) -> None:
    print("\n== Admission: trace replay (paper4 preset, disaggregated vs colocated) ==")
    print(f"{'policy':<12}{'arch. staleness':>17}{'violations':>12}{'1st mini-batch at':>19}")
    for name in replay_policies:
        print(
            f"{name:<12}{figures[f'replay.{name}.architectural_staleness']:>17.3f}"
            f"{figures[f'replay.{name}.violations']:>12d}"
            f"{figures[f'replay.{name}.first_minibatch_fraction']:>18.0%}"
        )
    print(f"rho (training time per train batch / rollout step) = {figures['replay.rho']:.2f}")
    print("\n== Admission: live stream (4 sources, GRPO n=8) ==")
    print(f"{'policy':<12}{'train batches meeting every quota':>36}{'1st mini-batch at':>19}")
    for name in ("knittrans", "barrier"):
        print(
            f"{name:<12}{figures[f'live.{name}.train_batches_meeting_quotas']:>30d} / "
            f"{figures[f'live.{name}.train_batches']:<3d}"
            f"{figures[f'live.{name}.first_minibatch_fraction']:>18.0%}"
        )
    print(
        "\n== Data path (DP=2 x CP=2, reorganizer processes, shared memory; 2 passes per step) =="
    )
    consumed = figures["bytes.consumed"]
    print(f"bytes consumed by trainers      {consumed / 2**20:10.2f} MiB")
    print(
        f"bytes read by knitkit           {figures['bytes.knitkit_read'] / 2**20:10.2f} MiB"
        f"  ({figures['bytes.knitkit_ratio']:.2f}x consumed)"
    )
    print(
        f"bytes a sample-level read moves {figures['bytes.sample_level_read'] / 2**20:10.2f} MiB"
        f"  ({figures['bytes.sample_level_ratio']:.2f}x consumed)"
    )
    print(
        f"exposed wait per micro-batch    {figures['prefetch.exposed_wait_ms_per_micro']:10.2f} ms"
        f"  (staging {figures['prefetch.stage_ms_per_micro']:.2f} ms, hidden by the prefetch thread)"
    )
    print(
        f"old log-probs written back      {figures['passes.written_back_bytes'] / 2**20:10.2f} MiB"
        "  (forward-only pass -> store -> train pass)"
    )
    print(f"units left in the store         {figures['units_left_in_store']:10d}")
    print("\n== Encoder dedup ==")
    print(
        f"encoder fwd+bwd, dup   {figures['encoder.dup_s']:8.3f} s  ({figures['encoder.dup_units']} encodings)"
    )
    print(
        f"encoder fwd+bwd, dedup {figures['encoder.dedup_s']:8.3f} s  ({figures['encoder.dedup_units']} encodings)"
    )
    runs = figures["encoder.dup_units"] / max(1, figures["encoder.dedup_units"])
    print(
        f"ratio dup / dedup      {figures['encoder.time_ratio']:8.2f}x time, {runs:.1f}x encodings"
    )
    print("\n== Training (loss = mean NLL of response tokens) ==")
    print("  ".join(f"{i + 1}:{loss:.3f}" for i, loss in enumerate(figures["loss"])))
    print(f"\nlive pipeline wall time {figures['live.wall_s']:.1f} s")


def plot_report(figures: dict[str, Any], live: PipelineResult, path: Path) -> None:
    """Write ``report_figure`` as a PNG."""
    fig = report_figure(figures, live)
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt  # after report_figure chose the Agg backend

    plt.close(fig)


def report_figure(figures: dict[str, Any], live: PipelineResult) -> Figure:
    """Loss per step; when each policy admitted each mini-batch; bytes moved; encoder runs and time.

    NOTE [ Demo plots say what they measure ]: each panel compares the policies or paths on the
    same quantity over the same range, and its title says which: the admissions panel covers
    only the mini-batches both policies admitted (the driver stops after its last train batch,
    the barrier shadow goes on with the stream), so a lower line is an earlier admission, not
    fewer; the encoder has two panels, encodings (a count) and forward + backward time (seconds),
    each with its own ratio, since dedup cuts the first by the group size and the second less.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(11, 8))
    grid = fig.add_gridspec(2, 2)
    ax = fig.add_subplot(grid[0, 0])
    ax.plot(range(1, len(figures["loss"]) + 1), figures["loss"], marker="o")
    ax.set(title="Training loss per optimizer step", xlabel="mini-batch step", ylabel="NLL")
    _admissions_panel(fig.add_subplot(grid[0, 1]), live)
    ax = fig.add_subplot(grid[1, 0])
    labels = ["consumed", "knitkit read", "sample-level read"]
    values = [
        figures["bytes.consumed"],
        figures["bytes.knitkit_read"],
        figures["bytes.sample_level_read"],
    ]
    ax.bar(labels, [v / 2**20 for v in values], color=["gray", "tab:green", "tab:red"])
    ax.set(title="Bytes moved for the same mini-batches", ylabel="MiB")
    encoder = grid[1, 1].subgridspec(1, 2, wspace=0.45)
    count, time = fig.add_subplot(encoder[0, 0]), fig.add_subplot(encoder[0, 1])
    _bars(count, (figures["encoder.dup_units"], figures["encoder.dedup_units"]), "runs", "{:.0f}")
    _bars(
        time, (figures["encoder.dup_s"], figures["encoder.dedup_s"]), "fwd+bwd time (s)", "{:.2f}"
    )
    fig.tight_layout()
    return fig


def _admissions_panel(ax: Axes, live: PipelineResult) -> None:
    """Cumulative mini-batches admitted over simulated rollout time, over the mini-batches every
    policy admitted (see NOTE [ Demo plots say what they measure ])."""
    shown = min((len(r.times_s) for r in live.admission.values()), default=0)
    for name, record in live.admission.items():
        times = record.times_s[:shown]
        mean = sum(times) / len(times) if times else float("nan")
        label = f"{name} (mean admission {mean:.0f} s)"
        ax.step(times, range(1, len(times) + 1), where="post", marker=".", label=label)
    ax.set(
        title=f"When each of the first {shown} mini-batches was admitted\n(left = earlier)",
        xlabel="simulated rollout seconds",
        ylabel="mini-batches admitted",
    )
    ax.legend(fontsize=8)


def _bars(ax: Axes, values: tuple[float, float], measured: str, fmt: str) -> None:
    """Dup against dedup for one measured quantity, with the ratio of the two in the title."""
    ax.bar(["dup", "dedup"], values, color=["tab:red", "tab:green"])
    for x, v in enumerate(values):
        ax.text(x, v, fmt.format(v), ha="center", va="bottom", fontsize=8)
    ratio = values[0] / values[1] if values[1] else float("nan")
    ax.set(title=f"Encoder {measured}\ndup / dedup = {ratio:.1f}x", ylabel=measured)


def _first_fraction(record: AdmissionRecord) -> float:
    """Of the first train batch's admission interval, the fraction before its first mini-batch."""
    times = [t for t, b in zip(record.times_s, record.train_batch, strict=True) if b == 0]
    return times[0] / times[-1] if times and times[-1] > 0 else float("nan")


def _complete_train_batches(record: AdmissionRecord, num_minibatches: int) -> set[int]:
    """Train batches whose every mini-batch was admitted before the stream ended."""
    return {b for b in set(record.train_batch) if record.train_batch.count(b) == num_minibatches}


def _quota_ok(record: AdmissionRecord, quotas: dict[str, int], complete: set[int]) -> int:
    """How many complete train batches hold at least each source's quota."""
    totals: dict[int, dict[str, int]] = {b: {} for b in complete}
    for batch, counts in zip(record.train_batch, record.composition, strict=True):
        if batch not in complete:
            continue
        merged = totals[batch]
        for source, count in counts.items():
            merged[source] = merged.get(source, 0) + count
    return sum(all(c.get(s, 0) >= q for s, q in quotas.items()) for c in totals.values())
