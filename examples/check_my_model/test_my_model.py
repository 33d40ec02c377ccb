"""The dedup wrap of ``my_vlm`` keeps its gradients at TP2 and DP2 x TP2 (CPU: gloo; GPUs: NCCL).

Run: python -m pytest -q examples/check_my_model
From a shell instead: python -m knitkit check-equivalence --nproc 2 --tp 2 --provider
my_vlm.model:provider --forward-step my_vlm.model:forward_step --trajectories
my_vlm.data:trajectories --python-path examples/check_my_model
"""

from __future__ import annotations

from pathlib import Path

import pytest

from knitkit.integration.megatron.testing import VLMUnderTest

HERE = (str(Path(__file__).resolve().parent),)
"""The folder holding ``my_vlm``: every spawned rank imports it from there."""
MY_VLM = VLMUnderTest(provider="my_vlm.model:provider", forward_step="my_vlm.model:forward_step")


@pytest.mark.parametrize("world_size", [2, 4], ids=["tp2", "dp2_tp2"])
def test_dedup_wrap_keeps_gradients(megatron_equivalence, world_size: int) -> None:
    report = megatron_equivalence.check(
        MY_VLM,
        "my_vlm.data:trajectories",
        tensor_parallel=2,
        world_size=world_size,
        python_path=HERE,
    )
    print(report.table())
    report.raise_if_failed(expect_below_floor=())  # every gradient compared relatively
