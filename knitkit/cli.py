"""The ``knitkit`` command: one subcommand per job, each module imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("knitkit.demo", "run the end-to-end pipeline on embedded defaults and print a report"),
    "replay": ("knitkit.admission.replay.cli", "replay a rollout trace under admission policies"),
    "check-equivalence": (
        "knitkit.integration.megatron.testing.cli",
        "check that the dedup wrap of your Megatron VLM keeps the unwrapped gradients",
    ),
    "shm-clean": (
        "knitkit.storage.backends.shm_clean",
        "remove /dev/shm segments left by dead knitkit processes",
    ),
}
"""name -> (module, help). Each module defines ``add_arguments(parser)`` and ``run(args) -> int``."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="knitkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        args = parser.parse_args(argv)  # prints help or the "invalid choice" error
        parser.print_help()
        return 2
    module_name, help_text = SUBCOMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    command_parser = argparse.ArgumentParser(
        prog=f"knitkit {argv[0]}",
        description=module.__doc__ or help_text,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    module.add_arguments(command_parser)
    args = command_parser.parse_args(argv[1:])
    return int(module.run(args))
