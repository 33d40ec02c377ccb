"""SGLang generate outputs -> knitkit store writes and admission metadata (sglang itself is optional)."""

from .response import (
    FinishReason,
    GenerateOutput,
    decode_routed_experts,
    parse_generate_output,
    parse_weight_version,
)
from .stream import StreamAccumulator, fold_stream, iter_sse_events
from .trajectory import (
    DecodedImage,
    ImageInput,
    PayloadConfig,
    RolloutRequest,
    build_trajectory,
    image_array,
    image_bytes,
    placeholder_runs,
)
from .writer import RolloutWriter

__all__ = [
    "DecodedImage",
    "FinishReason",
    "GenerateOutput",
    "ImageInput",
    "PayloadConfig",
    "RolloutRequest",
    "RolloutWriter",
    "StreamAccumulator",
    "build_trajectory",
    "decode_routed_experts",
    "fold_stream",
    "image_array",
    "image_bytes",
    "iter_sse_events",
    "parse_generate_output",
    "parse_weight_version",
    "placeholder_runs",
]
