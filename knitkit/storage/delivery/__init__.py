"""Delivery: reorganizer processes, shared-memory publication, per-rank consumers (README steps 7-9).

The face for engine adapters that host a reorganizer themselves (a Ray actor): they run a
``ReorganizerHost`` and unlink the rings of hosts that died with ``unlink_ring``; a consumer of
its own (one that follows a restarted reorganizer) hands out exact counts with ``Take``, waits for
a ring to appear on ``RingNotReadyError`` and names its producer with ``Producer``; a rank
watches its driver's schedule with ``ProducerWatch``; a process that runs a host is started with
``streaming_copies`` of its environment, as ``ReorganizerProcess`` starts its child. Users need
only ``ReorganizerProcess``, ``RingSpec`` and ``MicroBatchConsumer`` from ``knitkit.storage``.
"""

from knitkit.storage.delivery.consumer import (
    ConsumerClosedError,
    LeaseSource,
    MicroBatchConsumer,
    Producer,
    ProducerWatch,
    ReorganizerDiedError,
    ReorganizerError,
    ReorganizerUnitsLostError,
    Take,
)
from knitkit.storage.delivery.reorganizer import ReorganizerHost
from knitkit.storage.delivery.reorganizer_process import ReorganizerProcess
from knitkit.storage.delivery.slot_ring import (
    RingClosedError,
    RingNotReadyError,
    RingSpec,
    RingTruncatedError,
    unlink_ring,
)
from knitkit.storage.delivery.streaming_copies import streaming_copies

__all__ = [
    "ConsumerClosedError",
    "LeaseSource",
    "MicroBatchConsumer",
    "Producer",
    "ProducerWatch",
    "ReorganizerDiedError",
    "ReorganizerError",
    "ReorganizerHost",
    "ReorganizerProcess",
    "ReorganizerUnitsLostError",
    "RingClosedError",
    "RingNotReadyError",
    "RingSpec",
    "RingTruncatedError",
    "Take",
    "streaming_copies",
    "unlink_ring",
]
