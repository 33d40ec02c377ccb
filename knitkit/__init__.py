"""knitkit: a fast, quota-correct rollout-to-training data path for RL on vision-language models."""

from knitkit.types import (
    FieldView,
    MicroBatchLayout,
    MultimodalRef,
    SeqRange,
    TrajectoryMeta,
    UnitKey,
    UnitRead,
)

__version__ = "0.1.0"

__all__ = [
    "FieldView",
    "MicroBatchLayout",
    "MultimodalRef",
    "SeqRange",
    "TrajectoryMeta",
    "UnitKey",
    "UnitRead",
    "__version__",
]
