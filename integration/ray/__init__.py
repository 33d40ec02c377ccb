"""knitkit.integration.ray: the Ray object-store backend, node-local reorganizer actors, plan dispatch, control relays.

Importing this package does not import Ray; each name loads its module (and Ray) on first use
(see NOTE [ Ray loopback runtime ] in ``runtime.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .runtime import loopback_only, start_ray

if TYPE_CHECKING:
    from .backend import RayBackend, UnitDirectory, UnitsLostError
    from .dispatch import RayDispatcher, RingConfig
    from .relay import ControlRelay, RayControl
    from .reorganizer import ReorganizerActor

_MODULE_OF = {
    "RayBackend": "backend",
    "UnitDirectory": "backend",
    "UnitsLostError": "backend",
    "RayDispatcher": "dispatch",
    "RingConfig": "dispatch",
    "ReorganizerActor": "reorganizer",
    "ControlRelay": "relay",
    "RayControl": "relay",
}

__all__ = [
    "ControlRelay",
    "RayBackend",
    "RayControl",
    "RayDispatcher",
    "ReorganizerActor",
    "RingConfig",
    "UnitDirectory",
    "UnitsLostError",
    "loopback_only",
    "start_ray",
]


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
