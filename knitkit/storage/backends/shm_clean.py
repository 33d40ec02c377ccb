"""Remove /dev/shm segments (slabs, journals, slot rings) left behind by knitkit processes that died.

Only this user's segments whose creator pid no longer runs are removed (see NOTE [ Segment names ]
in ``knitkit/storage/backends/segments.py``); live owners are never touched. Run it after a
SIGKILLed trainer or reorganizer; do not run it where containers share /dev/shm across pid
namespaces.
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
    removed = sweep_dead_segments(args.directory, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    print(f"{verb} {len(removed)} segment(s) of dead knitkit processes in {args.directory}")
    return 0
