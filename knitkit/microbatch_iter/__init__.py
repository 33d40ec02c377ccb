"""knitkit.microbatch_iter: prefetch packed micro-batches into pinned host memory and the device (paper 5.2, 6)."""

from knitkit.microbatch_iter.batch import IterStats, MicroBatch, MicroBatchStats, field_tensors
from knitkit.microbatch_iter.iterator import MicroBatchIterator
from knitkit.microbatch_iter.pool import StagingRing, StagingSlot
from knitkit.microbatch_iter.source import SourceItem, plan_staging
from knitkit.microbatch_iter.transport import CpuTransport, CudaTransport, Transport, make_transport
from knitkit.microbatch_iter.worker import PrefetchThreads
from knitkit.types import PackedMicroBatch

__all__ = [
    "CpuTransport",
    "CudaTransport",
    "IterStats",
    "MicroBatch",
    "MicroBatchIterator",
    "MicroBatchStats",
    "PackedMicroBatch",
    "PrefetchThreads",
    "SourceItem",
    "StagingRing",
    "StagingSlot",
    "Transport",
    "field_tensors",
    "make_transport",
    "plan_staging",
]
