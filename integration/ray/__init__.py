"""knitkit.integration.ray: the Ray object-store backend, node-local reorganizer actors, plan dispatch."""

from .backend import RayBackend, UnitDirectory
from .dispatch import RayDispatcher, RingConfig
from .reorganizer import ReorganizerActor

__all__ = ["RayBackend", "RayDispatcher", "ReorganizerActor", "RingConfig", "UnitDirectory"]
