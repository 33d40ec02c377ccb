"""Kill and resume: the GRPO example SIGKILLed at random points, resumed, and checked against one uninterrupted run.

Each job runs ``examples/grpo_megatron.py`` (DP2 x TP2 under torchrun, gloo on CPU) with a
checkpoint at every step boundary and the exactly-once ledger. It is SIGKILLed (rank 0's whole
process group: the driver and its reorganizers; torchrun then stops the other ranks) at a random
point: ``rollout:<n>`` (the n-th rollout group written, first-run feed or the resumed driver's
re-writes), ``pass:<n>`` (the n-th pass finished) or ``save:<n>`` (the n-th checkpoint's files
written, before its rename); resumed with ``--resume`` and killed again at another random point,
``--per-job`` times, then run to the end. A kill point whose count the launch never reaches
(the run ended first) counts as tried, not fired. Per job, the final parameters of every rank
are compared with the uninterrupted run's, and the ledgers of the killed+resumed launches are
checked: every (mini-batch, pass, trajectory) of the uninterrupted run exactly once, nothing
else (``grpo/kill.py``).

    python benchmarks/kill_resume.py [--quick] [--json PATH] [--kills N] [--per-job K] [--seed S]

JSON keys: ``kill_points_tried``, ``kill_points_fired``, ``jobs``, ``jobs_resumed`` (ran to the
end after their kills), ``ledger_violations`` (must be 0), ``max_param_diff`` (any element,
any rank, any job), ``kill_points_fired.<point>`` (``rollout``, ``pass``, ``save``), ``steps``,
``wall_s``. Progress (each kill point, fired or not) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from grpo.kill import launch, ledger_violations, max_param_diff  # noqa: E402
from lifetime import end_on_sigterm  # noqa: E402
from progress import Progress  # noqa: E402

progress = Progress("kill_resume")

STEPS = 3
RANGES = {"rollout": (1, 4), "pass": (1, 3 * STEPS - 1), "save": (1, STEPS - 1)}
"""Kill point -> the counts drawn from (inclusive): 3 passes per step, a save per step."""


def main() -> None:
    end_on_sigterm()  # a SIGTERM ends the running job's torchrun, so its ranks (run_to_end)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 kill points in one job")
    parser.add_argument("--kills", type=int, default=24, help="kill points to try (>= 20)")
    parser.add_argument("--per-job", type=int, default=3, help="kills per job before it finishes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    kills = 3 if args.quick else args.kills
    rng = random.Random(args.seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="knitkit-kill-") as tmp:
        work = Path(tmp)
        reference = work / "reference"
        done = launch(reference, STEPS, resume=False)
        if done.returncode != 0:
            raise SystemExit(f"the uninterrupted run failed:\n{done.summary()}")
        report = _jobs(work, reference, kills, args.per_job, rng)
    report |= {"steps": STEPS, "wall_s": time.perf_counter() - started}
    for key, value in report.items():
        print(f"{key:<28} {value:g}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if report["ledger_violations"] or report["jobs_resumed"] != report["jobs"]:
        raise SystemExit("exactly-once violated or a job did not finish")


def _jobs(
    work: Path, reference: Path, kills: int, per_job: int, rng: random.Random
) -> dict[str, float]:
    tried = fired = jobs = resumed = violations = 0
    worst = 0.0
    fired_at = dict.fromkeys(sorted(RANGES), 0)
    while tried < kills:
        job = work / f"job{jobs}"
        jobs += 1
        first = True
        for _ in range(min(per_job, kills - tried)):
            point = rng.choice(sorted(RANGES))
            kill = f"{point}:{rng.randint(*RANGES[point])}"
            out = launch(job, STEPS, kill, resume=not first)
            first = False
            tried += 1
            fired += out.killed
            fired_at[point] += out.killed
            progress(f"job {jobs - 1}: {kill} {'fired' if out.killed else 'not reached'}")
            if not out.killed:
                if out.returncode != 0:
                    raise SystemExit(f"job {jobs - 1} failed at {kill}:\n{out.summary()}")
                break
        else:
            out = launch(job, STEPS, resume=not first)
            if out.returncode != 0:
                raise SystemExit(f"job {jobs - 1} failed to resume:\n{out.summary()}")
        resumed += 1
        broken = ledger_violations(job / "ledger", reference / "ledger")
        violations += len(broken)
        for line in broken[:5]:
            progress(f"job {jobs - 1}: {line}")
        worst = max(worst, max_param_diff(job / "final", reference / "final"))
    return {
        "kill_points_tried": tried,
        "kill_points_fired": fired,
        "jobs": jobs,
        "jobs_resumed": resumed,
        "ledger_violations": violations,
        "max_param_diff": worst,
        **{f"kill_points_fired.{point}": count for point, count in fired_at.items()},
    }


if __name__ == "__main__":
    main()
