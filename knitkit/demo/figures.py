"""The demo's per-step figures: each part's snapshot plus what only the demo measures, pushed to observers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from knitkit.admission import AdmissionController
from knitkit.encoder_dedup import DedupEncoder
from knitkit.metrics import MetricsObserver, merge, sum_over
from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.storage import MicroBatchConsumer, ReorganizerProcess, TrajectoryStore

LOSS = "knitkit/demo/loss"


def driver_figures(
    store: TrajectoryStore, reorganizers: Sequence[ReorganizerProcess]
) -> dict[str, float]:
    """The store's figures, and the bytes the reorganizer processes read from it (cumulative)."""
    read = sum(r.bytes_read for r in reorganizers)
    return merge(store.metrics(), {"knitkit/reorganizer/bytes_read": read})


def rank_figures(
    micro_batches: MicroBatchIterator,
    consumers: Sequence[MicroBatchConsumer],
    dedup: DedupEncoder,
) -> dict[str, float]:
    """One rank after a step: its prefetch iterator's and ring consumers' totals (backbone ring,
    and the encoder ring on encoder ranks), and its dedup figures of the step's mini-batch."""
    return merge(
        micro_batches.metrics(), sum_over([c.metrics() for c in consumers]), dedup.metrics()
    )


@dataclass(slots=True)
class StepLog:
    """Merges one training step's figures (driver objects + every rank's) and pushes them.

    Admission figures are taken when the trained mini-batch is admitted (``admitted``), the
    store's and the ranks' once every rank finished the step (``log``); see NOTE [ Parts are
    pulled, observers are pushed ].
    """

    observe: MetricsObserver
    store: TrajectoryStore
    reorganizers: Sequence[ReorganizerProcess]
    _admission: dict[str, dict[str, float]] = field(default_factory=dict)
    steps: int = 0

    def admitted(self, minibatch_id: str, controller: AdmissionController) -> None:
        """Right after ``controller`` admitted the mini-batch planned as ``minibatch_id``."""
        self._admission[minibatch_id] = controller.metrics()

    def log(self, minibatch_id: str, loss: float, ranks: Sequence[dict[str, float]]) -> None:
        """``ranks``: each rank's figures after the step; counters and seconds are summed."""
        self.steps += 1
        figures = merge(
            self._admission.pop(minibatch_id),
            driver_figures(self.store, self.reorganizers),
            sum_over(ranks),
            {LOSS: loss},
        )
        self.observe(self.steps, figures)
