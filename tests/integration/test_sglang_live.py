"""The SGLang adapter against a live engine: real outputs parse, store and admit like the recordings.

Runs where sglang and a CUDA GPU are present; the model is ``$KNITKIT_SGLANG_MODEL``
(default Qwen/Qwen2.5-0.5B-Instruct, a local path or a Hugging Face id already in the cache).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from knitkit.integration.sglang import RolloutRequest, RolloutWriter, fold_stream
from knitkit.storage import MemoryBackend, TrajectoryStore
from knitkit.types import UnitKey

MODEL = os.environ.get("KNITKIT_SGLANG_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None or not torch.cuda.is_available(),
        reason="needs sglang and a GPU",
    ),
]


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    import sglang

    engine = sglang.Engine(model_path=MODEL, mem_fraction_static=0.3, log_level="error")
    yield engine
    engine.shutdown()


def _prompt_ids(text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL).encode(text)


def test_live_grpo_batch_and_stream_are_stored(engine: Any) -> None:
    """n=4 real outputs and one real stream become stored trajectories with consistent fields."""
    prompt = _prompt_ids("Count from one to ten:")
    params = {"max_new_tokens": 16, "temperature": 1.0, "n": 4}
    outputs = engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True)
    assert isinstance(outputs, list) and len(outputs) == 4
    requests = [RolloutRequest(f"g-{i}", "g", "live", 0, tuple(prompt)) for i in range(4)]
    store = TrajectoryStore(MemoryBackend())
    writer = RolloutWriter(store)
    metas = writer.add_batch(requests, outputs)
    for meta, raw in zip(metas, outputs, strict=True):
        assert meta is not None and meta.num_tokens == len(prompt) + len(raw["output_ids"])
        logprobs = store.read(UnitKey(meta.trajectory_id, "logprobs"))
        assert (logprobs[len(prompt) :] <= 0).all()
    chunks = engine.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 16}, return_logprob=True, stream=True
    )
    (streamed,) = fold_stream(chunks)
    meta = writer.add(RolloutRequest("st", "st", "live", 0, tuple(prompt)), streamed)
    assert meta is not None and meta.num_tokens > len(prompt)
