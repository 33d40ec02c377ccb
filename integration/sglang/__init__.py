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
    PayloadConfig,
    RolloutRequest,
    build_trajectory,
    image_bytes,
    placeholder_runs,
)
from .writer import RolloutWriter

__all__ = [
    "FinishReason",
    "GenerateOutput",
    "PayloadConfig",
    "RolloutRequest",
    "RolloutWriter",
    "StreamAccumulator",
    "build_trajectory",
    "decode_routed_experts",
    "fold_stream",
    "image_bytes",
    "iter_sse_events",
    "parse_generate_output",
    "parse_weight_version",
    "placeholder_runs",
]
