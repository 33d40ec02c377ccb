"""Driver checkpoints: save and load time, bytes against the state they cover, and the pause a save imposes on the loop.

For each size and store backend (``shm``: shared memory, the default; ``disk``: a durable
``SafetensorsBackend`` in a temporary directory), a driver (one process, its reorganizer
processes; no ranks) takes ``n`` synthetic VLM trajectories (``knitkit.storage.baselines``; GRPO groups of 4, 64 to
512 tokens, an image each, routing fields), admits them into mini-batches of 16, and is
checkpointed with nothing trained (``state_dict(trained=0)``: every mini-batch pending, the
largest state a step boundary can hold for these trajectories). Timed, median over
``--repeats``:

- ``state_dict_s``: the driver builds its state (holding its lock: writes and serving wait;
  on ``disk`` it includes flushing the backend's buffered units to a shard);
- ``save_s``: JSON encoding, owner-only write, fsync, marker, rename (``CheckpointDir``);
- ``pause_s``: both, what a synchronous save at the step boundary costs the training loop
  (rank 0's part; the ranks' own model/optimizer files come on top and are the user's);
- ``load_s``: reading the newest checkpoint and ``load_state_dict`` on a fresh driver (on
  ``disk`` over the same directory: the store's index is restored too and, with nothing to
  re-write, the pending mini-batches are re-planned and registered inside it);
- ``reissue_s``: re-writing the trajectories the resumed driver names (every pending and
  waiting one on ``shm``; none on ``disk``, where the units survived), re-planning and
  registering every pending mini-batch (the rollout's regeneration is not included);
- ``reissued``: how many trajectories the resumed driver named;
- ``checkpoint_bytes`` against ``store_payload_bytes`` (the units the checkpoint does not hold:
  see NOTE [ Resume rule ] in knitkit/job/checkpoint_state.py) and ``bytes_per_trajectory``.

    python benchmarks/checkpoint.py [--quick] [--json PATH] [--sizes N ...] [--repeats R]
                                    [--backends shm disk]

JSON (flat): ``n<size>.<figure>`` (shm) and ``n<size>.disk.<figure>`` for each size and the
figures above (plus ``.trajectories``), and ``repeats``.

The admission controller's own state (issue 30.3: it used to list every id ever reported), for
``reported`` trajectories settled before and ``pending`` waiting (knittrans, GRPO groups of 8,
two sources with 50% quotas, the backlog all of one source, so it stays pending):
``admission.r<reported>_p<pending>.<figure>`` with ``snapshot_s`` (the copy a lock holder pays:
``AdmissionController.snapshot()``), ``save_s`` (encoding the snapshot, JSON, owner-only write,
fsync), ``load_s`` (reading it and ``load_state_dict`` on a fresh controller, every invariant
checked), ``bytes``, and ``save_cpu_s`` / ``load_cpu_s`` (process CPU time: figures that hold on
a busy shared machine). Sizes: reported 0 and 2M, pending 0 and 1M (``--quick``: 200k and 100k);
``--admission-only`` runs just these.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from progress import Progress

from knitkit.admission import AdmissionController, SourceQuota, build_controller
from knitkit.job import Driver, Output, Pass
from knitkit.job.checkpoint import CheckpointDir, read_json, write_json
from knitkit.storage import (
    EncoderTopology,
    PlannerConfig,
    SafetensorsBackend,
    Topology,
    Trajectory,
    TrajectoryStore,
)
from knitkit.storage.baselines import synthetic_trajectories
from knitkit.types import TrajectoryMeta

progress = Progress("checkpoint")

GROUP = 4
MINIBATCH = 16
PASSES = (
    Pass("old", reads=("tokens",), writes=(Output("old_lp"),), forward_only=True, encodes=True),
    Pass("train", reads=("tokens", "old_lp"), encodes=True),
)


def build(trajectories: list[Trajectory], store: TrajectoryStore | None) -> Driver:
    sources = sorted({t.source for t in trajectories})
    admission = build_controller(
        "streaming",
        train_batch_size=len(trajectories),
        num_minibatches=len(trajectories) // MINIBATCH,
        sources=sources,
    )
    return Driver.Config(
        passes=PASSES,
        topology=Topology(dp=2, cp=1, tp=1),
        encoders=(EncoderTopology("vision", dp=2),),
        planner=PlannerConfig(max_tokens_per_micro_batch=1024),
        slot_bytes=1 << 20,
        schedule_slot_bytes=1 << 20,
        write_back_slot_bytes=1 << 16,
        schedule_slots=2,
    ).build(admission=admission, store=store)


def measure(size: int, repeats: int, root: Path, backend: str) -> dict[str, float]:
    data = synthetic_trajectories(size // GROUP, group_size=GROUP, seed=size)
    by_id = {t.trajectory_id: t for t in data}
    runs: dict[str, list[float]] = {}
    ckpt = CheckpointDir(root / f"n{size}-{backend}")

    def store(step: int) -> TrajectoryStore | None:
        directory = root / f"n{size}-{backend}-units-{step}"
        return None if backend == "shm" else TrajectoryStore(SafetensorsBackend(str(directory)))

    for step in range(1, repeats + 1):
        with build(data, store(step)) as driver:
            for trajectory in data:
                driver.write(trajectory)
            payload = driver.store.metrics().get("knitkit/storage/bytes_live", 0.0)
            t0 = time.perf_counter()
            state = driver.state_dict(trained=0)
            t1 = time.perf_counter()
            write_json(ckpt.stage(step) / "knitkit.json", state)
            ckpt.commit(step)
            t2 = time.perf_counter()
        if backend != "shm":
            driver.store.close()
        latest = ckpt.latest()
        assert latest is not None
        nbytes = (latest / "knitkit.json").stat().st_size
        with build(data, store(step)) as driver:
            t3 = time.perf_counter()
            driver.load_state_dict(read_json(latest / "knitkit.json"))
            t4 = time.perf_counter()
            reissued = driver.reissue()
            for tid in reissued:
                driver.write(by_id[tid])
            t5 = time.perf_counter()
            assert driver.reissue() == ()
        if backend != "shm":
            driver.store.close()
        for name, value in (
            ("state_dict_s", t1 - t0),
            ("save_s", t2 - t1),
            ("pause_s", t2 - t0),
            ("load_s", t4 - t3),
            ("reissue_s", t5 - t4),
            ("reissued", float(len(reissued))),
            ("checkpoint_bytes", float(nbytes)),
            ("store_payload_bytes", payload),
        ):
            runs.setdefault(name, []).append(value)
    out = {name: statistics.median(values) for name, values in runs.items()}
    out["trajectories"] = float(size)
    out["bytes_per_trajectory"] = out["checkpoint_bytes"] / size
    return out


ADMISSION_GROUP = 8


def admission_controller() -> AdmissionController:
    return build_controller(
        "knittrans",
        train_batch_size=256,
        num_minibatches=4,
        sources=["fast", "slow"],
        quotas=[SourceQuota(source=s, min_ratio=0.5) for s in ("fast", "slow")],
        group_size=ADMISSION_GROUP,
    )


def admission_state(reported: int, pending: int, root: Path) -> dict[str, float]:
    """Save and load times and bytes of a controller that settled ``reported`` trajectories
    (admitted in full train batches) and holds ``pending`` ones of the fast source, waiting on
    the slow one."""
    ctl = admission_controller()
    for k in range(reported):
        source = "fast" if k // ADMISSION_GROUP % 2 else "slow"
        ctl.report(TrajectoryMeta(f"r{k:09d}", f"r{k // 8}", source, k // 4096, 300, 0, 0))
        if k % ADMISSION_GROUP == ADMISSION_GROUP - 1:
            while ctl.next_minibatch() is not None:
                pass
    for k in range(pending):
        ctl.report(TrajectoryMeta(f"p{k:09d}", f"p{k // 8}", "fast", 9999, 300, 0, 0))
    while ctl.next_minibatch() is not None:
        pass
    assert ctl.pending >= pending - 256, "the backlog must stay pending"
    path = root / f"admission-r{reported}-p{pending}.json"
    cpu, wall = time.process_time, time.perf_counter
    t0, c0 = wall(), cpu()
    snapshot = ctl.snapshot()
    t1 = wall()
    write_json(path, snapshot.state_dict())
    t2, c2 = wall(), cpu()
    del snapshot
    fresh = admission_controller()
    t3, c3 = wall(), cpu()
    fresh.load_state_dict(read_json(path))
    t4, c4 = wall(), cpu()
    assert fresh.metrics() == ctl.metrics()
    return {
        "snapshot_s": t1 - t0,
        "save_s": t2 - t0,
        "save_cpu_s": c2 - c0,
        "load_s": t4 - t3,
        "load_cpu_s": c4 - c3,
        "bytes": float(path.stat().st_size),
    }


def admission_cases(quick: bool, root: Path) -> dict[str, float]:
    reported_sizes, pending_sizes = (
        ((200_000,), (100_000,)) if quick else ((2_000_000,), (1_000_000,))
    )
    report: dict[str, float] = {}
    print(f"\n{'reported':>10} {'pending':>9} {'snapshot_s':>10} {'save_s':>8} {'(cpu)':>7} "
          f"{'load_s':>8} {'(cpu)':>7} {'MB':>7}")  # fmt: skip
    for reported in (0, *reported_sizes):
        for pending in (0, *pending_sizes):
            figures = admission_state(reported, pending, root)
            prefix = f"admission.r{reported}_p{pending}"
            report |= {f"{prefix}.{name}": value for name, value in figures.items()}
            progress(f"admission state, {reported} reported, {pending} pending: done")
            print(
                f"{reported:>10} {pending:>9} {figures['snapshot_s']:>10.4f} "
                f"{figures['save_s']:>8.3f} {figures['save_cpu_s']:>7.3f} "
                f"{figures['load_s']:>8.3f} {figures['load_cpu_s']:>7.3f} "
                f"{figures['bytes'] / 1e6:>7.2f}"
            )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="sizes 64 and 512 (of the full run's), 2 repeats"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", nargs="+", choices=("shm", "disk"), default=["shm", "disk"])
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--admission-only", action="store_true", help="only the admission controller's state"
    )
    args = parser.parse_args()
    sizes, repeats = ([64, 512], 2) if args.quick else (args.sizes, args.repeats)
    report: dict[str, float] = {"repeats": float(repeats)}
    rows = [] if args.admission_only else [(n, backend) for n in sizes for backend in args.backends]
    with tempfile.TemporaryDirectory(prefix="knitkit-ckpt-bench-") as tmp:
        for n, backend in rows:
            figures = measure(n, repeats, Path(tmp), backend)
            report |= {f"{_prefix(n, backend)}.{name}": value for name, value in figures.items()}
            progress(f"{n} trajectories on {backend}: done")
    names = ("state_dict_s", "save_s", "pause_s", "load_s", "reissue_s", "reissued")
    if rows:
        print(f"{'trajectories':>12} {'backend':>8} " + " ".join(f"{n:>13}" for n in names))
    for n, backend in rows:
        figures = [report[f"{_prefix(n, backend)}.{name}"] for name in names]
        print(f"{n:>12} {backend:>8} " + " ".join(f"{value:>13.4g}" for value in figures))
    with tempfile.TemporaryDirectory(prefix="knitkit-ckpt-bench-") as tmp:
        report |= admission_cases(args.quick, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def _prefix(size: int, backend: str) -> str:
    return f"n{size}" if backend == "shm" else f"n{size}.{backend}"


if __name__ == "__main__":
    main()
