"""knitkit on megatron-core: topology from ``parallel_state``, THD batches, and the dedup VLM train step."""

from knitkit.encoder_dedup import feature_slices
from knitkit.integration.megatron.batch import (
    Batch,
    block_causal_mask,
    megatron_batch,
    megatron_batches,
    packed_seq_params,
)
from knitkit.integration.megatron.llava import LLaVADedup, LLaVASequence, llava_sequence
from knitkit.integration.megatron.mrope import (
    MROPE_FIELD,
    disable_rotary_cp_slicing,
    mrope_batch,
    mrope_position_ids,
    mrope_positions,
)
from knitkit.integration.megatron.pipeline import PipelineStage, check_microbatches_agree
from knitkit.integration.megatron.step import DedupVLMStep
from knitkit.integration.megatron.te import (
    FP8_PAD_MULTIPLE,
    LayerSpecs,
    batch_for,
    layer_specs,
    te_available,
)
from knitkit.integration.megatron.topology import Coord, MegatronLayout

__all__ = [
    "FP8_PAD_MULTIPLE",
    "MROPE_FIELD",
    "Batch",
    "Coord",
    "DedupVLMStep",
    "LLaVADedup",
    "LLaVASequence",
    "LayerSpecs",
    "MegatronLayout",
    "PipelineStage",
    "batch_for",
    "block_causal_mask",
    "check_microbatches_agree",
    "disable_rotary_cp_slicing",
    "feature_slices",
    "layer_specs",
    "llava_sequence",
    "megatron_batch",
    "megatron_batches",
    "mrope_batch",
    "mrope_position_ids",
    "mrope_positions",
    "packed_seq_params",
    "te_available",
]
