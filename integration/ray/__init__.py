"""knitkit.integration.ray: the Ray object-store backend, node-local reorganizer actors, plan dispatch."""

from .backend import RayBackend, UnitDirectory, UnitsLostError
from .dispatch import RayDispatcher, RingConfig
from .reorganizer import ReorganizerActor
from .runtime import loopback_only, start_ray

__all__ = [
    "RayBackend",
    "RayDispatcher",
    "ReorganizerActor",
    "RingConfig",
    "UnitDirectory",
    "UnitsLostError",
    "loopback_only",
    "start_ray",
]
