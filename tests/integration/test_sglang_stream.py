"""Folding a streamed /generate request (SSE) into one output, with per-chunk weight versions."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sglang_fixtures import load

from knitkit.integration.sglang import StreamAccumulator, fold_stream, iter_sse_events


def _fold(name: str) -> tuple[StreamAccumulator, list[dict]]:
    record = load(name)
    chunks = list(iter_sse_events(record["response_body"].splitlines(keepends=True)))
    acc = StreamAccumulator()
    for chunk in chunks:
        acc.feed(chunk)
    return acc, chunks


@pytest.mark.parametrize("name", ["stream_incremental.json", "stream_cumulative.json"])
def test_both_streaming_modes_fold_to_the_same_output(name: str) -> None:
    """Incremental and cumulative streams yield every token once, in order, with its log-prob."""
    acc, chunks = _fold(name)
    out = acc.result()
    final = chunks[-1]["meta_info"]
    assert len(out.output_ids) == final["completion_tokens"] == 18
    assert out.finish is not None and out.finish.kind == "stop"
    assert out.output_ids[-1] == out.finish.matched
    assert out.logprobs is not None and len(out.logprobs) == len(out.output_ids)
    assert out.e2e_latency == pytest.approx(final["e2e_latency"])
    if name == "stream_cumulative.json":
        ids = chunks[-1]["output_ids"]
        entries = final["output_token_logprobs"]
    else:
        ids = [t for chunk in chunks for t in chunk["output_ids"]]
        entries = [e for chunk in chunks for e in chunk["meta_info"]["output_token_logprobs"]]
    assert out.output_ids.tolist() == ids
    np.testing.assert_allclose(out.logprobs, [entry[0] for entry in entries], rtol=1e-6)


def test_versions_track_a_weight_update_mid_request() -> None:
    """Tokens streamed before an in-place weight update keep the old version; first_version says so."""
    acc, _ = _fold("stream_incremental.json")
    out = acc.result()
    assert acc.versions == [(0, "3"), (9, "4")]
    assert (out.first_version, out.weight_version) == ("3", "4")


def test_feed_rejects_gaps_and_chunks_after_finish() -> None:
    """A chunk that does not extend the output, or arrives after the finish, is an error."""
    _, chunks = _fold("stream_incremental.json")
    acc = StreamAccumulator()
    acc.feed(chunks[0])
    with pytest.raises(ValueError, match="does not extend"):
        acc.feed(chunks[2])
    with pytest.raises(ValueError, match="no finish_reason"):
        acc.result()
    done = StreamAccumulator()
    for chunk in chunks:
        done.feed(chunk)
    with pytest.raises(ValueError, match="already finished"):
        done.feed(chunks[-1])


def test_sse_error_chunk_raises() -> None:
    """SGLang's mid-stream error chunk surfaces as ValueError with its message."""
    body = ["data: " + json.dumps({"error": {"message": "input too long"}}), "", "data: [DONE]"]
    with pytest.raises(ValueError, match="input too long"):
        list(iter_sse_events(body))
    assert list(iter_sse_events([b": keep-alive", b"data: [DONE]", b"data: {}"])) == []


def test_batched_stream_folds_per_index() -> None:
    """Interleaved chunks of an n=2 stream fold into two outputs in batch order, none mixed."""
    record = load("stream_batch_n2.json")
    chunks = list(iter_sse_events(record["response_body"].splitlines()))
    outputs = fold_stream(chunks)
    assert len(outputs) == 2
    for index, out in enumerate(outputs):
        mine = [c for c in chunks if c["index"] == index]
        assert out.output_ids.tolist() == [t for c in mine for t in c["output_ids"]]
        assert out.rid == mine[0]["meta_info"]["id"]
        assert out.prompt_tokens == len(record["request"]["input_ids"])
    assert [len(o.output_ids) for o in outputs] == [7, 10]
    with pytest.raises(ValueError, match="missing"):
        fold_stream([c for c in chunks if c["index"] == 1])
