"""knitkit.integration.ray: the Ray object-store backend, node-local reorganizer actors, plan dispatch."""

from knitkit.integration.ray.backend import RayBackend, UnitDirectory

__all__ = ["RayBackend", "UnitDirectory"]
