"""Remove /dev/shm segments (slabs, journals, slot rings) left behind by knitkit processes that died.

Only this user's segments whose owner is dead are removed: a backend's segments once its owner
lock is free, a slot ring once its owner's lock on the ring file is free, in any pid namespace
that shares the directory (see NOTE [ Segment names ] in ``knitkit/storage/backends/segments.py``
for exactly what goes); live owners are never touched.
Run it after a SIGKILLed trainer or reorganizer. Entries it cannot remove are listed with the
reason; they never stop it.
"""

from __future__ import annotations

import argparse

from knitkit.storage.backends.segments import SHM_DIR, sweep_dead_segments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--directory", default=SHM_DIR, help="where the segments live")
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would be removed, remove nothing"
    )


def run(args: argparse.Namespace) -> int:
    report = sweep_dead_segments(args.directory, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in report.removed:
        print(f"{verb} {path}")
    for path, why in report.skipped.items():
        print(f"skipped {path}: {why}")
    print(f"{verb} {len(report.removed)} segment(s) of dead knitkit processes in {args.directory}")
    return 0
