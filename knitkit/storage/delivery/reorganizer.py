"""The reorganizer loop: read one consumer's assignment, pack it micro-batch by micro-batch, publish."""

from __future__ import annotations

import numpy as np

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.planning.packing import RowSpec, pack_into, pack_layout
from knitkit.storage.planning.plan import ConsumerPlan, EncoderRankPlan, MicroBatchPlan
from knitkit.types import MicroBatchLayout, UnitKey, UnitRead


class Reorganizer:
    """Serves one (DP, CP) group (or one encoder rank): reads only its ranges, publishes in order.

    It runs in any process that can read ``backend`` and map the publisher's ring: a spawned
    process (``ReorganizerProcess``), a Ray actor, or a test's own process. Each micro-batch is
    laid out from the plan, then read straight into its ring slot (no staging copy) and
    published as soon as it is complete, so consumers start on micro-batch 0 while later ones
    are still being read; the ring's slot count bounds the look-ahead.
    """

    def __init__(self, backend: UnitBackend, publisher: Publisher) -> None:
        self.backend = backend
        self.publisher = publisher
        self._schema: dict[str, RowSpec] = {}

    def deliver(self, minibatch_id: str, plan: ConsumerPlan | EncoderRankPlan) -> int:
        """Publish every micro-batch of ``plan`` in consumption order; returns how many."""
        count = len(plan.micro_batches)
        if isinstance(plan, ConsumerPlan):
            self._learn_schema(plan)
        for index in range(count):
            extra: dict[str, int | float | str] = {
                "minibatch_id": minibatch_id,
                "micro_batch": index,
                "num_micro_batches": count,
            }
            before = self.backend.bytes_read
            if isinstance(plan, ConsumerPlan):
                self._publish_backbone(plan.micro_batches[index], extra)
            else:
                self._publish_encoder(plan.micro_batches[index], extra)
            self.publisher.ring.add_bytes_read(self.backend.bytes_read - before)
        return count

    def _publish_backbone(
        self, micro_batch: MicroBatchPlan, extra: dict[str, int | float | str]
    ) -> None:
        layout = pack_layout(micro_batch, self._schema, extra)
        slot = self.publisher.acquire(layout.nbytes)
        pack_into(micro_batch, layout, slot, self._read_into)
        self.publisher.publish(layout)

    def _publish_encoder(
        self, units: tuple[UnitKey, ...], extra: dict[str, int | float | str]
    ) -> None:
        """An encoder micro-batch: each unique multimodal unit whole, as a field named by its key."""
        specs = {str(k): (self.backend.spec(k).dtype, self.backend.spec(k).shape) for k in units}
        layout = MicroBatchLayout.build(
            specs, trajectory_ids=tuple(str(k) for k in units), extra=extra
        )
        slot = self.publisher.acquire(layout.nbytes)
        views = layout.numpy_views(slot)
        for key in units:
            self.backend.read(key, None, out=views[str(key)])
        self.publisher.publish(layout)

    def _read_into(self, read: UnitRead, out: np.ndarray) -> None:
        self.backend.read(read.key, read.ranges, out=out)

    def _learn_schema(self, plan: ConsumerPlan) -> None:
        """dtype and row shape of every field, from the first trajectory that has it (so an
        empty micro-batch still gets a layout)."""
        for micro_batch in plan.micro_batches:
            fields = (*micro_batch.token_fields, *micro_batch.scalar_fields)
            for seq in micro_batch.sequences:
                for name in fields:
                    if name not in self._schema:
                        spec = self.backend.spec(UnitKey(seq.trajectory_id, name))
                        row = spec.shape[1:] if name in micro_batch.token_fields else spec.shape
                        self._schema[name] = (spec.dtype, row)
                return
