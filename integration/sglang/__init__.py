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
    EnvironmentTokens,
    PayloadConfig,
    RolloutRequest,
    Segment,
    build_trajectory,
    segments_from_mask,
)
from .vision import (
    DecodedImage,
    ImageInput,
    VideoInput,
    image_array,
    image_bytes,
    placeholder_runs,
)
from .writer import RolloutWriter

__all__ = [
    "DecodedImage",
    "EnvironmentTokens",
    "FinishReason",
    "GenerateOutput",
    "ImageInput",
    "PayloadConfig",
    "RolloutRequest",
    "RolloutWriter",
    "Segment",
    "StreamAccumulator",
    "VideoInput",
    "build_trajectory",
    "decode_routed_experts",
    "fold_stream",
    "image_array",
    "image_bytes",
    "iter_sse_events",
    "parse_generate_output",
    "parse_weight_version",
    "placeholder_runs",
    "segments_from_mask",
]
