"""Parsing one SGLang /generate output: ids, log-probs, routed experts, finish reason, version."""

from __future__ import annotations

import base64
import copy

import numpy as np
import pytest
from sglang_fixtures import load

from knitkit.integration.sglang import (
    decode_routed_experts,
    iter_sse_events,
    parse_generate_output,
    parse_weight_version,
)


def test_batch_outputs_parse_to_aligned_arrays() -> None:
    """Every output of an n=4 batch keeps its ids, per-token log-probs and finish reason."""
    record = load("vlm_grpo_batch.json")
    outputs = [parse_generate_output(out) for out in record["response"]]
    assert [o.finish.kind for o in outputs if o.finish] == ["stop", "stop", "stop", "length"]
    assert outputs[0].finish is not None and outputs[0].finish.matched == 151645
    assert outputs[3].finish is not None and outputs[3].finish.length == 32
    for raw, out in zip(record["response"], outputs, strict=True):
        assert out.output_ids.dtype == np.int32
        assert out.output_ids.tolist() == raw["output_ids"]
        assert out.logprobs is not None and out.logprobs.dtype == np.float32
        expected = [entry[0] for entry in raw["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(out.logprobs, expected, rtol=1e-6)
        assert out.prompt_tokens == len(record["request"]["input_ids"][0])
        assert out.weight_version == out.first_version == "7"
        assert out.num_tokens == out.prompt_tokens + len(raw["output_ids"])


def test_routed_experts_decode_to_rows_layers_topk() -> None:
    """routed_experts is base64 int32 [prompt + completion - 1, layers, topk], bit-exact."""
    record = load("moe_routed_experts.json")
    shape = (record["num_hidden_layers"], record["num_experts_per_tok"])
    out = parse_generate_output(record["response"], routing_shape=shape)
    rows = len(record["request"]["input_ids"]) + len(record["response"]["output_ids"]) - 1
    assert out.routed_experts is not None
    assert out.routed_experts.shape == (rows, *shape)
    raw = base64.b64decode(record["response"]["meta_info"]["routed_experts"])
    assert out.routed_experts.astype("<i4").tobytes() == raw
    assert out.routed_experts.min() >= 0 and out.routed_experts.max() < 128
    flat = parse_generate_output(record["response"]).routed_experts
    assert flat is not None and flat.shape == (rows, shape[0] * shape[1])


def test_routed_experts_shape_mismatch_names_the_request() -> None:
    """A wrong routing shape or start length is an error naming the request id."""
    record = load("moe_routed_experts.json")
    rid = record["response"]["meta_info"]["id"]
    with pytest.raises(ValueError, match=rid):
        parse_generate_output(record["response"], routing_shape=(47, 8))
    with pytest.raises(ValueError, match="not a multiple"):
        decode_routed_experts(record["response"]["meta_info"]["routed_experts"], 7)


def test_inconsistent_logprobs_are_rejected() -> None:
    """Log-prob entries must match output_ids one to one, token for token."""
    out = copy.deepcopy(load("vlm_grpo_batch.json")["response"][0])
    out["meta_info"]["output_token_logprobs"][2][1] += 1
    with pytest.raises(ValueError, match="differ from output_ids"):
        parse_generate_output(out)
    out["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(ValueError, match="output_token_logprobs for"):
        parse_generate_output(out)


def test_completion_tokens_must_count_the_output_ids() -> None:
    """``meta_info.completion_tokens`` is checked against ``output_ids`` (issue 22 item 18): a
    truncated response, or one stream chunk passed as the whole output, is refused by request id."""
    out = copy.deepcopy(load("vlm_grpo_batch.json")["response"][0])
    rid = out["meta_info"]["id"]
    del out["meta_info"]["output_token_logprobs"]  # so only the count can catch it
    out["output_ids"].pop()
    with pytest.raises(
        ValueError, match=rf"request '{rid}': meta_info.completion_tokens=22 but 21"
    ):
        parse_generate_output(out)
    out["meta_info"]["completion_tokens"] = 21
    assert len(parse_generate_output(out).output_ids) == 21
    del out["meta_info"]["completion_tokens"]  # engines that do not report it: nothing to check
    assert len(parse_generate_output(out).output_ids) == 21
    record = load("stream_incremental.json")
    chunk = list(iter_sse_events(record["response_body"].splitlines()))[1]  # a delta of 4 of 5
    chunk["meta_info"]["finish_reason"] = {"type": "stop", "matched": 151645}
    with pytest.raises(ValueError, match=r"completion_tokens=5 but 4"):
        parse_generate_output(chunk)


def test_abort_and_error_outputs() -> None:
    """An aborted output parses as a partial rollout; an error body or unknown reason raises."""
    exchange = load("partial_rollout.json")["exchanges"][0]
    out = parse_generate_output(exchange["response"])
    assert out.finish is not None and out.finish.aborted and out.finish.message == "Aborted"
    with pytest.raises(ValueError, match="error"):
        parse_generate_output({"error": {"message": "bad input"}})
    bad = copy.deepcopy(exchange["response"])
    bad["meta_info"]["finish_reason"] = {"type": "eos"}
    with pytest.raises(ValueError, match="'eos'"):
        parse_generate_output(bad)
    with pytest.raises(ValueError, match="output_ids"):
        parse_generate_output({"text": "hi", "meta_info": {}})


def test_weight_version_mapping() -> None:
    """'default' is the initial version; integers parse; other labels say how to fix them."""
    assert parse_weight_version("default") == 0
    assert parse_weight_version("default", initial=5) == 5
    assert parse_weight_version("12") == 12
    with pytest.raises(ValueError, match="version_of"):
        parse_weight_version("ckpt-a")


def _moe_with_routing(value: object, dtype: str | None) -> tuple[dict, np.ndarray, tuple[int, int]]:
    """The recorded MoE output with its routings re-sent as ``value`` (and ``routed_experts_dtype``)."""
    record = load("moe_routed_experts.json")
    shape = (record["num_hidden_layers"], record["num_experts_per_tok"])
    expected = parse_generate_output(record["response"], routing_shape=shape).routed_experts
    assert expected is not None
    response = copy.deepcopy(record["response"])
    response["meta_info"]["routed_experts"] = value(expected) if callable(value) else value
    if dtype is not None:
        response["meta_info"]["routed_experts_dtype"] = dtype
    return response, expected, shape


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_routed_experts_follow_the_reported_wire_dtype(dtype: str) -> None:
    """``meta_info.routed_experts_dtype`` (sglang PR 31219: uint8 / uint16 / int32 wire encodings)
    decides how the base64 payload is read; the ids come out equal and int32."""
    wire = {"uint8": "u1", "uint16": "<u2", "int32": "<i4"}[dtype]

    def encode(ids: np.ndarray) -> str:
        return base64.b64encode(ids.astype(wire).tobytes()).decode()

    response, expected, shape = _moe_with_routing(encode, dtype)
    out = parse_generate_output(response, routing_shape=shape)
    assert out.routed_experts is not None and out.routed_experts.dtype == np.int32
    assert np.array_equal(out.routed_experts, expected)


@pytest.mark.parametrize("form", ["numpy", "list"])
def test_routed_experts_as_raw_arrays_with_skip_tokenizer_init(form: str) -> None:
    """With ``skip_tokenizer_init`` the tokenizer manager passes the routings through unencoded
    (sglang PR 24263): an array (in-process engine) or nested lists (JSON) decode alike."""

    def raw(ids: np.ndarray) -> object:
        return ids.astype(np.int32) if form == "numpy" else ids.tolist()

    response, expected, shape = _moe_with_routing(raw, None)
    out = parse_generate_output(response, routing_shape=shape)
    assert out.routed_experts is not None and out.routed_experts.dtype == np.int32
    assert np.array_equal(out.routed_experts, expected)


def test_unknown_routed_experts_dtype_is_named() -> None:
    """A wire dtype the adapter does not know fails with the value and the known ones."""
    response, _, shape = _moe_with_routing(lambda ids: "", "int4")
    with pytest.raises(ValueError, match=r"'int4'.*uint8"):
        parse_generate_output(response, routing_shape=shape)
