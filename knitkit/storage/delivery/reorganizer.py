"""The reorganizer loop: read one consumer's assignment, pack it micro-batch by micro-batch, publish."""

from __future__ import annotations

from knitkit.storage.backends.backend import UnitBackend
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.planning.packing import RowSpec, pack_into_batched, pack_layout
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
        pack_into_batched(micro_batch, layout, slot, self.backend.read_many)
        self.publisher.publish(layout)

    def _publish_encoder(
        self, units: tuple[UnitKey, ...], extra: dict[str, int | float | str]
    ) -> None:
        """An encoder micro-batch: each unique multimodal unit whole (``MicroBatchLayout.of_units``)."""
        specs = {k: (self.backend.spec(k).dtype, self.backend.spec(k).shape) for k in units}
        layout = MicroBatchLayout.of_units(specs, extra=extra)
        slot = self.publisher.acquire(layout.nbytes)
        views = layout.unit_views(slot)
        self.backend.read_many([UnitRead(key) for key in views], list(views.values()))
        self.publisher.publish(layout)

    def _learn_schema(self, plan: ConsumerPlan) -> None:
        """dtype and row shape of every field the plan packs.

        From the plan's own schema (``TrajectoryStore.register`` fills it in), else from the
        first of this consumer's trajectories that has the field, else from an earlier
        mini-batch. An idle DP rank has no trajectories to learn from, so without a schema its
        (empty) micro-batches cannot be laid out: that is an error naming the fields.
        """
        self._schema.update(plan.row_specs)
        for micro_batch in plan.micro_batches:
            for name in (*micro_batch.token_fields, *micro_batch.scalar_fields):
                if name in self._schema or not micro_batch.sequences:
                    continue
                spec = self.backend.spec(UnitKey(micro_batch.sequences[0].trajectory_id, name))
                row = spec.shape[1:] if name in micro_batch.token_fields else spec.shape
                self._schema[name] = (spec.dtype, row)
        needed = {f for mb in plan.micro_batches for f in (*mb.token_fields, *mb.scalar_fields)}
        missing = sorted(needed - set(self._schema))
        if missing:
            raise KeyError(
                f"consumer {plan.name}: no dtype/shape for fields {missing} and no trajectory to "
                "learn them from; submit the plan returned by TrajectoryStore.register (it "
                "carries every field's schema)"
            )
