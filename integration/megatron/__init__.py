"""knitkit on megatron-core: topology from ``parallel_state``, THD batches, and the dedup VLM train step."""

from knitkit.encoder_dedup import feature_slices
from knitkit.integration.megatron.batch import (
    Batch,
    PackedShape,
    PackedShapes,
    block_causal_mask,
    megatron_batch,
    megatron_batches,
    packed_seq_params,
)
from knitkit.integration.megatron.device import current_device
from knitkit.integration.megatron.llava import LLaVADedup, LLaVASequence, llava_sequence
from knitkit.integration.megatron.mrope import (
    MROPE_FIELD,
    MROPE_SCHEMES,
    MRopeScheme,
    disable_rotary_cp_slicing,
    mrope_batch,
    mrope_position_ids,
    mrope_positions,
    placeholder_runs,
)
from knitkit.integration.megatron.pipeline import (
    PipelineStage,
    StepRefused,
    check_microbatches_agree,
)
from knitkit.integration.megatron.rank import MegatronPass, MegatronRank
from knitkit.integration.megatron.routing import ROUTING_FIELD, routing_dtype, stage_layers
from knitkit.integration.megatron.routing_replay import ForwardStep, RoutingReplay
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
    "MROPE_SCHEMES",
    "ROUTING_FIELD",
    "Batch",
    "Coord",
    "DedupVLMStep",
    "ForwardStep",
    "LLaVADedup",
    "LLaVASequence",
    "LayerSpecs",
    "MRopeScheme",
    "MegatronLayout",
    "MegatronPass",
    "MegatronRank",
    "PackedShape",
    "PackedShapes",
    "PipelineStage",
    "RoutingReplay",
    "StepRefused",
    "batch_for",
    "block_causal_mask",
    "check_microbatches_agree",
    "current_device",
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
    "placeholder_runs",
    "routing_dtype",
    "stage_layers",
    "te_available",
]
