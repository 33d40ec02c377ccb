"""Streaming SGLang outputs into a real TrajectoryStore and admitting them: the rollout-side path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sglang_fixtures import load

from knitkit.admission import AdmissionController, policy_config
from knitkit.integration.sglang import (
    PayloadConfig,
    RolloutRequest,
    RolloutWriter,
    StreamAccumulator,
    iter_sse_events,
)
from knitkit.storage import MemoryBackend, SafetensorsBackend, TrajectoryStore
from knitkit.types import UnitKey

IMAGE_PAD = 151655


@pytest.fixture(params=["memory", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> TrajectoryStore:
    if request.param == "memory":
        return TrajectoryStore(MemoryBackend())
    return TrajectoryStore(SafetensorsBackend(str(tmp_path / "shards"), shard_bytes=64 << 10))


def _prompt_request(tid: str, input_ids: list[int], **kw: object) -> RolloutRequest:
    return RolloutRequest(tid, "s", "math", 0, tuple(input_ids), **kw)  # type: ignore[arg-type]


def test_grpo_batch_is_stored_once_per_image_and_admitted(store: TrajectoryStore) -> None:
    """n=4 outputs become 4 trajectories sharing 2 image units; their metas admit as one GRPO group."""
    record = load("vlm_grpo_batch.json")
    body = record["request"]
    requests = [
        RolloutRequest(
            f"s0-{i}", "s0", "chart", 2, tuple(body["input_ids"][0]), tuple(body["image_data"][0])
        )
        for i in range(4)
    ]
    writer = RolloutWriter(store, PayloadConfig(image_token_id=IMAGE_PAD))
    metas = writer.add_batch(requests, record["response"])
    assert all(m is not None for m in metas)
    stored = list(store.backend.keys())
    assert len([k for k in stored if k.field == "image"]) == 2
    assert len(stored) == 4 * 4 + 2  # tokens, labels, loss_mask, logprobs each, plus 2 images
    assert [store.meta(r.trajectory_id) for r in requests] == metas
    for request, raw in zip(requests, record["response"], strict=True):
        prompt = len(request.input_ids)
        generated = store.read(UnitKey(request.trajectory_id, "tokens"), [(prompt, prompt + 5)])
        assert generated.tolist() == raw["output_ids"][:5]
        # next-token convention (knitkit/next_token.py): the prompt's last position predicts
        # the first generated token and holds its log-prob
        logprobs = store.read(UnitKey(request.trajectory_id, "logprobs"), [(prompt - 1, prompt)])
        assert logprobs[0] == pytest.approx(raw["meta_info"]["output_token_logprobs"][0][0])
    controller = AdmissionController(
        policy_config(
            "knittrans", train_batch_size=4, num_minibatches=1, sources=("chart",), group_size=4
        )
    )
    for meta in metas:
        assert meta is not None
        controller.report(meta)
    minibatch = controller.next_minibatch()
    assert minibatch is not None
    assert {t.trajectory_id for t in minibatch.trajectories} == {r.trajectory_id for r in requests}


def test_partial_rollout_waits_for_its_continuation(store: TrajectoryStore) -> None:
    """An aborted output stores nothing; its continuation completes one trajectory over both versions."""
    first, second = load("partial_rollout.json")["exchanges"]
    request = _prompt_request("t0", first["request"]["input_ids"])
    writer = RolloutWriter(store)
    assert writer.add(request, first["response"]) is None
    assert writer.partial == ("t0",) and list(store.backend.keys()) == []
    assert writer.continuation_ids(request) == second["request"]["input_ids"]
    meta = writer.add(request, second["response"])
    assert meta is not None and (meta.min_version, meta.max_version) == (4, 5)
    assert writer.partial == ()
    tokens = store.read(UnitKey("t0", "tokens"))
    assert tokens.tolist() == second["request"]["input_ids"] + second["response"]["output_ids"]
    with pytest.raises(KeyError, match="no aborted output"):
        writer.continuation_ids(request)


def test_streamed_output_spans_the_versions_it_saw(store: TrajectoryStore) -> None:
    """A stream that straddled a weight update is stored with min_version 3 and max_version 4."""
    record = load("stream_incremental.json")
    acc = StreamAccumulator()
    for chunk in iter_sse_events(record["response_body"].splitlines()):
        acc.feed(chunk)
    meta = RolloutWriter(store).add(
        _prompt_request("t1", record["request"]["input_ids"]), acc.result()
    )
    assert meta is not None and (meta.min_version, meta.max_version) == (3, 4)
    first_chunk = next(iter_sse_events(record["response_body"].splitlines()))
    with pytest.raises(ValueError, match="still running"):
        RolloutWriter(store).add(_prompt_request("t2", record["request"]["input_ids"]), first_chunk)


def test_moe_routing_is_stored_for_sliced_reads(store: TrajectoryStore) -> None:
    """The routing field is [seq, layers, topk] uint8; a CP-style range read returns exactly those rows."""
    record = load("moe_routed_experts.json")
    shape = (record["num_hidden_layers"], record["num_experts_per_tok"])
    request = _prompt_request("t3", record["request"]["input_ids"])
    config = PayloadConfig(routing_shape=shape, num_experts=128)
    meta = RolloutWriter(store, config).add(request, record["response"])
    assert meta is not None
    routing = store.read(UnitKey("t3", "routing"))
    assert routing.shape == (meta.num_tokens, *shape) and routing.dtype == np.uint8
    rows = store.read(UnitKey("t3", "routing"), [(3, 7), (meta.num_tokens - 2, meta.num_tokens)])
    np.testing.assert_array_equal(rows[:4], routing[3:7])
    assert (rows[-1] == np.arange(shape[1])).all()
    with pytest.raises(KeyError, match="already stored"):
        RolloutWriter(store, config).add(request, record["response"])
