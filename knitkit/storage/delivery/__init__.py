"""Delivery: reorganizer processes, shared-memory publication, per-rank consumers (README steps 7-9).

The face for engine adapters that host a reorganizer themselves (a Ray actor); users need only
``ReorganizerProcess``, ``RingSpec`` and ``MicroBatchConsumer`` from ``knitkit.storage``.
"""

from knitkit.storage.delivery.consumer import (
    MicroBatchConsumer,
    ReorganizerDiedError,
    ReorganizerError,
)
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer import Reorganizer
from knitkit.storage.delivery.reorganizer_process import Assignment, ReorganizerProcess
from knitkit.storage.delivery.slot_ring import RingClosedError, RingSpec, SlotRing, unlink_ring

__all__ = [
    "Assignment",
    "MicroBatchConsumer",
    "Publisher",
    "Reorganizer",
    "ReorganizerDiedError",
    "ReorganizerError",
    "ReorganizerProcess",
    "RingClosedError",
    "RingSpec",
    "SlotRing",
    "unlink_ring",
]
