"""Real multi-process torch.distributed worlds for tests (the library's spawned worlds, re-exported).

Usage: ``from dist import World, run_world``; see ``knitkit.integration.megatron.testing.world``.
"""

from knitkit.integration.megatron.testing.world import WorkerError, World, free_port, run_world

__all__ = ["WorkerError", "World", "free_port", "run_world"]
