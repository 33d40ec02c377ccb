"""Small records (a header plus named arrays) over a shared-memory slot ring, in order."""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from knitkit.storage import MemoryBackend
from knitkit.storage.delivery import MicroBatchConsumer, Producer, ReorganizerHost, RingSpec
from knitkit.storage.planning import EncoderRankPlan
from knitkit.types import UnitKey

# NOTE [ Records over slot rings ]: the job's two control channels, driver -> ranks (the
# schedule) and writer rank -> driver (write-backs and pass ends), are streams of small
# records read in order by processes on one node. They reuse the data path's ring and its
# publication protocol unchanged (NOTE [ Micro-batch publication protocol ]): a producer runs a
# ``ReorganizerHost`` over a private ``MemoryBackend``, puts a record's arrays there as units and
# delivers them as one unit micro-batch (an ``EncoderRankPlan`` of those keys), so the ring
# copies them into a slot and publishes; the header (JSON) rides in the layout's
# ``minibatch_id`` string. A reader is a ``MicroBatchConsumer``. So the channels get what the
# rings already guarantee: bounded memory (a full ring blocks the producer), data-only decoding
# (a layout record never runs code: no pickle), liveness (a dead producer raises
# ``ReorganizerDiedError``, a failed one ``ReorganizerError`` with its message, a consumer that
# died holding a slot fails the producer) and errors carried to the reader (``fail``).
# Lifecycle table: docs/lifecycle.md.

_RECORD = "record"
"""The encoder name of the unit micro-batches that carry records (never a real encoder)."""


@dataclass(frozen=True, slots=True)
class Record:
    """One record: its header and its arrays (private copies, by name)."""

    header: dict[str, Any]
    arrays: dict[str, np.ndarray]


class RecordWriter:
    """The producer of a record ring; ``owns_ring`` creates it (and unlinks it in ``close``)."""

    def __init__(
        self,
        spec: RingSpec,
        *,
        owns_ring: bool,
        role: str,
        liveness_timeout_s: float | None = None,
    ) -> None:
        """``role`` names the writer in the errors its readers get (the driver, a writer rank);
        ``liveness_timeout_s``: its readers' bound, which paces its heartbeat (NOTE [ Heartbeat
        period ] in knitkit/storage/delivery/publication.py)."""
        self.spec = spec
        self._backend = MemoryBackend()
        self._host = ReorganizerHost(
            self._backend,
            spec,
            owns_ring=owns_ring,
            role=role,
            liveness_timeout_s=liveness_timeout_s,
        )
        self._numbers = itertools.count()

    def send(
        self, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None
    ) -> None:
        """Publish one record; blocks while the ring is full (every reader must release a slot).

        Raises what stopped it (``ValueError`` for a record larger than a slot, naming the ring's
        ``slot_bytes``); ring errors as ``ReorganizerHost.deliver`` raises them.
        """
        owner = f"r{next(self._numbers)}"
        keys = []
        try:
            for name, array in (arrays or {}).items():
                key = UnitKey(owner, name)
                self._backend.put(key, np.atleast_1d(np.ascontiguousarray(array)))
                keys.append(key)
            plan = EncoderRankPlan(_RECORD, 0, (tuple(keys),))
            self._host.deliver(json.dumps(dict(header), separators=(",", ":")), plan)
        finally:
            for key in keys:
                self._backend.delete(key)

    @property
    def published(self) -> int:
        """Records published so far."""
        return self._host.published

    @property
    def readers(self) -> int:
        """How many readers the ring has (attached or not)."""
        return self.spec.num_consumers

    def readers_attached(self) -> int:
        """How many of the ring's readers are attached now."""
        return self._host.consumers_attached()

    def finish(self) -> None:
        """No more records: readers stop after the last one."""
        self._host.finish()

    def fail(self, message: str) -> None:
        """End the ring with an error: readers raise ``ReorganizerError`` carrying ``message``."""
        self._host.fail(message)

    def stop(self) -> None:
        """Make a ``send`` blocked on a full ring give up (any thread)."""
        self._host.stop()

    def close(self) -> None:
        self._host.close()


class RecordReader:
    """One reader of a record ring (consumer ``index``), attached for its lifetime."""

    def __init__(
        self,
        spec: RingSpec,
        index: int,
        *,
        producer: Producer,
        liveness_timeout_s: float = 30.0,
        wait_timeout_s: float = 600.0,
    ) -> None:
        """``producer`` names the writer in this reader's errors."""
        self.spec = spec
        self._consumer = MicroBatchConsumer(
            spec,
            index,
            liveness_timeout_s=liveness_timeout_s,
            startup_timeout_s=math.inf,  # a writer rank may start long after the ring exists
            wait_timeout_s=wait_timeout_s,
            producer=producer,
        )

    def next(
        self, timeout_s: float | None = None, *, cancel: threading.Event | None = None
    ) -> Record | None:
        """The next record, or ``None`` once the writer finished; ``MicroBatchConsumer``'s errors
        (``ReorganizerError`` with the writer's message, ``ReorganizerDiedError``,
        ``TimeoutError``, ``ConsumerClosedError``; ``InterruptedError`` once ``cancel`` is set,
        the reader unchanged) otherwise."""
        try:
            lease = self._consumer.next_micro_batch(timeout_s, cancel=cancel)
        except StopIteration:
            return None
        with lease:
            header = json.loads(str(lease.layout.extra["minibatch_id"]))
            units = lease.layout.unit_views(lease.buffer)
            arrays = {key.field: np.array(view) for key, view in units.items()}
        return Record(header, arrays)

    def metrics(self) -> dict[str, float]:
        return self._consumer.metrics()

    def close(self) -> None:
        """Detach; a ``next`` waiting in another thread raises ``ConsumerClosedError`` at once."""
        self._consumer.close()
