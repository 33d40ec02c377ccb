"""knitkit on megatron-core: topology from ``parallel_state``, THD batches, and the dedup VLM train step."""

from knitkit.integration.megatron.batch import (
    Batch,
    block_causal_mask,
    megatron_batch,
    megatron_batches,
    packed_seq_params,
)
from knitkit.integration.megatron.step import DedupVLMStep
from knitkit.integration.megatron.topology import Coord, MegatronLayout, feature_slices

__all__ = [
    "Batch",
    "Coord",
    "DedupVLMStep",
    "MegatronLayout",
    "block_causal_mask",
    "feature_slices",
    "megatron_batch",
    "megatron_batches",
    "packed_seq_params",
]
