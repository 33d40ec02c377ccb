"""Multi-turn agent rollouts through the SGLang adapter (NOTE [ Multi-turn trajectories ]).

Invariant: a tool-calling episode (assistant turns, tool responses between them, one turn aborted
by a weight update and continued) is ONE stored trajectory whose tokens are exactly what the
engine saw, with ``loss_mask`` and ``logprobs`` at the predicting position of every generated
token and nowhere else (NOTE [ Next-token alignment ]); verl's and slime's flat records
(response ids + 0/1 mask + log-probs) store the same fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from sglang_fixtures import load

from knitkit.integration.sglang import (
    EnvironmentTokens,
    PayloadConfig,
    RolloutRequest,
    RolloutWriter,
    build_trajectory,
    parse_generate_output,
    segments_from_mask,
)
from knitkit.storage import MemoryBackend, TrajectoryStore
from knitkit.types import UnitKey

FIELDS = ("tokens", "labels", "loss_mask", "logprobs")


def episode() -> dict[str, Any]:
    """The recorded tool-agent episode (see data/sglang/README.md)."""
    return load("multi_turn_tool_agent.json")


def request_for(record: dict[str, Any], tid: str = "agent-0") -> RolloutRequest:
    return RolloutRequest(
        tid, "q0", "tools", 3, tuple(record["steps"][0]["request"]["input_ids"]), issued_version=3
    )


def replay(writer: RolloutWriter, request: RolloutRequest, record: dict[str, Any]) -> Any:
    """Feed the episode as a rollout loop does; each turn's request must be continuation_ids."""
    steps = record["steps"]
    meta = None
    for i, step in enumerate(steps):
        if "environment" in step:
            writer.add_environment(request, step["environment"]["input_ids"])
            continue
        if i:
            assert writer.continuation_ids(request) == step["request"]["input_ids"]
        if i == len(steps) - 1:
            meta = writer.add(request, step["response"])
        elif step["response"]["meta_info"]["finish_reason"]["type"] == "abort":
            assert writer.add(request, step["response"]) is None
        else:
            writer.add_turn(request, step["response"])
        assert request.trajectory_id in writer.partial or i == len(steps) - 1
    return meta


def generated(record: dict[str, Any]) -> Iterator[tuple[int, int, float]]:
    """(token index, token id, SGLang log-prob) of every token the policy sampled."""
    at = len(record["steps"][0]["request"]["input_ids"])
    for step in record["steps"]:
        if "environment" in step:
            at += len(step["environment"]["input_ids"])
            continue
        for lp, token, _ in step["response"]["meta_info"]["output_token_logprobs"]:
            yield at, token, lp
            at += 1


def full_sequence(record: dict[str, Any]) -> list[int]:
    last = record["steps"][-1]
    return [*last["request"]["input_ids"], *last["response"]["output_ids"]]


def stored(store: TrajectoryStore, tid: str) -> dict[str, np.ndarray]:
    return {name: store.read(UnitKey(tid, name)) for name in FIELDS}


def test_tool_agent_episode_is_one_trajectory_trained_only_where_generated() -> None:
    """Turns, tool responses and a continued partial turn store one trajectory: position t holds
    token t+1 as its label, mask 1 and SGLang's log-prob iff the policy sampled token t+1."""
    record = episode()
    store = TrajectoryStore(MemoryBackend())
    meta = replay(RolloutWriter(store), request_for(record), record)
    assert meta is not None and (meta.min_version, meta.max_version) == (3, 4)
    tokens = full_sequence(record)
    fields = stored(store, "agent-0")
    assert fields["tokens"].tolist() == tokens
    assert fields["labels"].tolist() == [*tokens[1:], 0]
    mask = np.zeros(len(tokens))
    logprobs = np.zeros(len(tokens), dtype=np.float32)
    for at, token, lp in generated(record):
        assert tokens[at] == token
        mask[at - 1], logprobs[at - 1] = 1, lp
    np.testing.assert_array_equal(fields["loss_mask"], mask)
    np.testing.assert_array_equal(fields["logprobs"], logprobs)
    environment = [s["environment"]["input_ids"] for s in record["steps"] if "environment" in s]
    assert mask.sum() == len(tokens) - len(record["steps"][0]["request"]["input_ids"]) - sum(
        map(len, environment)
    )


def test_verl_and_slime_flat_records_store_the_same_fields() -> None:
    """verl's AgentLoopOutput / slime's Sample shape (response ids, 0/1 response mask, log-probs
    0.0 on tool tokens) stores the same tokens, labels, mask and log-probs as turn by turn."""
    record = episode()
    by_turns = TrajectoryStore(MemoryBackend())
    replay(RolloutWriter(by_turns), request_for(record), record)
    prompt = len(record["steps"][0]["request"]["input_ids"])
    response = full_sequence(record)[prompt:]
    mask = [0] * len(response)
    logprobs = [0.0] * len(response)  # what verl's ToolAgentLoop puts on tool tokens
    for at, _, lp in generated(record):
        mask[at - prompt], logprobs[at - prompt] = 1, lp
    flat = TrajectoryStore(MemoryBackend())
    segments = segments_from_mask(
        response, mask, logprobs, prompt_tokens=prompt, weight_version="4", rid="agent-0"
    )
    assert sum(isinstance(s, EnvironmentTokens) for s in segments) == 2
    meta = RolloutWriter(flat).write(request_for(record), segments)
    assert (meta.min_version, meta.max_version) == (3, 4)
    for name, value in stored(by_turns, "agent-0").items():
        np.testing.assert_array_equal(stored(flat, "agent-0")[name], value, err_msg=name)
    with pytest.raises(ValueError, match="response_mask must be 0/1"):
        segments_from_mask(response, [2] * len(response), prompt_tokens=prompt)
    with pytest.raises(ValueError, match="response_logprobs for"):
        segments_from_mask(response, mask, logprobs[:-1], prompt_tokens=prompt)


def test_episode_may_end_on_environment_tokens() -> None:
    """An episode that ends on environment tokens (verl's interaction loop ends on the user's
    last message): ``finish`` stores it, the trailing tokens untrained."""
    record = episode()
    steps = record["steps"]
    store = TrajectoryStore(MemoryBackend())
    writer = RolloutWriter(store)
    request = request_for(record)
    writer.add_turn(request, steps[0]["response"])
    writer.add_environment(request, steps[1]["environment"]["input_ids"])
    meta = writer.finish(request)
    assert writer.partial == ()
    fields = stored(store, "agent-0")
    turn = len(steps[0]["response"]["output_ids"])
    prompt = len(request.input_ids)
    assert meta.num_tokens == prompt + turn + len(steps[1]["environment"]["input_ids"])
    assert fields["loss_mask"].tolist() == [0] * (prompt - 1) + [1] * turn + [0] * (
        meta.num_tokens - prompt - turn + 1
    )


def test_misplaced_turns_are_refused_with_what_to_send() -> None:
    """A turn whose prompt skipped the tool tokens (or re-tokenised them), tool tokens before any
    turn or after an aborted one: errors naming the trajectory and output, nothing stored."""
    record = episode()
    steps = record["steps"]
    request = request_for(record)
    store = TrajectoryStore(MemoryBackend())
    writer = RolloutWriter(store)
    with pytest.raises(ValueError, match="add_turn"):
        writer.add_environment(request, [1, 2])
    writer.add_turn(request, steps[0]["response"])
    rid = steps[-1]["response"]["meta_info"]["id"]
    with pytest.raises(
        ValueError, match=rf"'agent-0': output '{rid}' has prompt_tokens=.*continuation_ids"
    ):
        writer.add(request, steps[-1]["response"])  # the tool responses were never added
    assert writer.continuation_ids(request) == [
        *request.input_ids,
        *steps[0]["response"]["output_ids"],
    ]
    writer.add_environment(request, steps[1]["environment"]["input_ids"])
    assert writer.add(request, steps[2]["response"]) is None  # aborted: held for its continuation
    with pytest.raises(ValueError, match="was aborted; continue it"):
        writer.add_environment(request, [1, 2])
    writer.drop("agent-0")
    assert writer.partial == () and list(store.backend.keys()) == []
    with pytest.raises(KeyError, match="holds no output"):
        writer.finish(request)
    turns = [parse_generate_output(s["response"]) for s in steps if "response" in s]
    with pytest.raises(ValueError, match=r"was aborted; continue it .* before the environment"):
        build_trajectory(
            request,
            [turns[0], EnvironmentTokens((1,)), turns[1], EnvironmentTokens((1,))],
            PayloadConfig(),
        )


def _turn(rid: str, prompt_tokens: int, output_ids: list[int]) -> dict[str, Any]:
    """A finished /generate output in SGLang's wire format."""
    return {
        "output_ids": output_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "stop", "matched": 151645},
            "prompt_tokens": prompt_tokens,
            "weight_version": "1",
            "completion_tokens": len(output_ids),
            "output_token_logprobs": [[-0.5, t, None] for t in output_ids],
        },
    }


def test_images_returned_by_a_tool_are_units_with_qwen_vl_positions() -> None:
    """A GUI-style episode: the prompt's image and the screenshot a tool returns are units at
    their runs, and ``mrope_position_ids`` over the whole episode equal transformers'
    Qwen2.5-VL ``get_rope_index``; a tool image whose grid does not match its run is refused."""
    from qwen_vl_reference import IMAGE_TOKEN, get_rope_index

    from knitkit.integration.megatron import MROPE_FIELD

    start, end = 151652, 151653  # <|vision_start|>, <|vision_end|>
    prompt = [151644, 872, 198, start, *[IMAGE_TOKEN] * 4, end, 3838, 30, 151645, 198]
    request = RolloutRequest(
        "gui-0", "g", "gui", 0, tuple(prompt), images=(b"page",), image_grid_thw=((1, 4, 4),)
    )
    store = TrajectoryStore(MemoryBackend())
    writer = RolloutWriter(store, PayloadConfig(image_token_id=IMAGE_TOKEN))
    writer.add_turn(request, _turn("t1", len(prompt), [151657, 4340, 151658, 151645]))
    screenshot = [198, 151644, 872, 198, start, *[IMAGE_TOKEN] * 8, end, 151645, 198]
    writer.add_environment(request, screenshot, images=(b"shot",), image_grid_thw=((1, 4, 8),))
    tokens = writer.continuation_ids(request)
    meta = writer.add(request, _turn("t2", len(tokens), [785, 151645]))
    assert meta is not None
    tokens += [785, 151645]
    runs = [(r.token_start, r.num_tokens) for r in meta.multimodal]
    screenshot_at = len(prompt) + 4 + 5  # turn 1, then the 5 template tokens before the run
    assert runs == [(4, 4), (screenshot_at, 8)]
    reference = get_rope_index("qwen2_5_vl", [tokens], [(1, 4, 4), (1, 4, 8)])[0]
    np.testing.assert_array_equal(store.read(UnitKey("gui-0", MROPE_FIELD)), reference.T)
    wrong = dataclasses.replace(request, trajectory_id="gui-1")
    writer.add_turn(wrong, _turn("t1", len(prompt), [151657, 4340, 151658, 151645]))
    writer.add_environment(wrong, screenshot, images=(b"shot",), image_grid_thw=((1, 4, 4),))
    with pytest.raises(ValueError, match=r"'gui-1': image 1: grid \(1, 4, 4\) needs 4 image"):
        writer.add(wrong, _turn("t2", len(tokens) - 2, [785, 151645]))
