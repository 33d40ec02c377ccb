"""The GRPO example's stand-in work (benchmarks/grpo_step.py): the vision path's is paid per image row it encodes, on every path alike."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from grpo.train import StandIn

from knitkit.types import UnitKey

ROWS, TOKENS, IMAGES = 6, 24, 16
"""An image's rows, a trajectory's tokens, trajectories of one image (a GRPO group x 2)."""


class _Matmuls(TorchFunctionMode):
    """Counts the matmuls torch runs inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        self.count += getattr(func, "__name__", "") == "matmul"  # ``x @ w`` and ``torch.matmul``
        return func(*args, **(kwargs or {}))


def _batches() -> list[dict[str, Any]]:
    """One trajectory per micro-batch, each with the group's image (as the plain loop builds)."""
    pixels = torch.zeros(ROWS, 12)
    return [
        {"tokens": torch.zeros(1, TOKENS), "images": [(pixels, 0, ROWS)]} for _ in range(IMAGES)
    ]


def _matmuls(run: Callable[[], object]) -> int:
    with _Matmuls() as counted:
        run()
    return counted.count


def test_vision_path_work_per_encoded_row_on_every_path() -> None:
    """At ``--work 8`` and Qwen2.5-VL-7B's ratio (0.36), 16 micro-batches of 24 tokens cost the
    backbone 3 matmuls each (48); encoding their image in every forward costs the vision path
    16 x 6 rows x 8 x 0.36 / 64 = 4.32 matmuls (4, the fraction owed), and so does encoding
    the same 96 rows through a dedup encode function; one dedup encode of the image (6 rows,
    0.27 of a matmul each time) is carried until it adds up rather than dropped. Ratio 0: the
    backbone's work alone, as before the vision path had any."""
    backbone = IMAGES * round(TOKENS / 64 * 8)

    def plain(work: StandIn) -> Callable[[], object]:
        return lambda: list(work.after_each(_batches(), encodes=True))

    assert _matmuls(plain(StandIn(per_token=8))) == backbone
    assert _matmuls(plain(StandIn(per_token=8, encoder_ratio=0.0))) == backbone
    assert _matmuls(plain(StandIn(per_token=8, encoder_ratio=0.36))) == backbone + 4

    deduped = StandIn(per_token=8, encoder_ratio=0.36)  # features served, not encoded inline
    assert _matmuls(lambda: list(deduped.after_each(_batches(), encodes=False))) == backbone

    def image(keys: Sequence[UnitKey]) -> torch.Tensor:
        return torch.zeros(ROWS * len(keys), 4)

    encode = deduped.encoding(image)
    key = [UnitKey("s0-p0", "image")]
    counts = [_matmuls(lambda: encode(key)) for _ in range(IMAGES)]
    assert sum(counts) == 4, counts  # the same rows, the same work
    assert counts[:3] == [0, 0, 0] and counts[3] == 1, counts  # 0.27 each: owed, then paid
    assert deduped.ran == {"backbone": backbone, "encoder": 4}
    assert StandIn(per_token=8).encoding(image) is image
