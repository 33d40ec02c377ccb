"""MoE routing from SGLang's payloads to what each rank reads (issue 33.1, 33.2).

A recorded Qwen3-30B-A3B ``/generate`` output (48 layers, top-8 of 128 experts) goes through the
``RolloutWriter`` as a GRPO group and, split into two turns around environment tokens, as a
multi-turn agent episode whose second turn reports from its ``routed_experts_start`` in SGLang's
narrow uint8 wire encoding. The stored field is uint8 ``[tokens, 48, 8]``; every (DP, CP)
consumer's packed micro-batches (CP zigzag chunks, padding) hold exactly their tokens' rows, bit
for bit, and reading them moves exactly those rows: no consumer reads the whole field. Under PP2
each stage's consumer reads its tokens x its 24 layers, one 2-D read per trajectory.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sglang_fixtures import load

from knitkit.integration.sglang import PayloadConfig, RolloutRequest, RolloutWriter
from knitkit.storage import (
    MemoryBackend,
    PlannerConfig,
    SafetensorsBackend,
    Topology,
    TrajectoryStore,
    plan_minibatch,
)
from knitkit.storage.planning import StageLayers, pack_into, pack_into_batched, pack_layout
from knitkit.types import UnitKey

EXPERTS = 128
ENVIRONMENT = (151644, 872, 198, 27, 14172, 29, 151645, 198, 151644, 77091, 198)
"""Tool-response tokens the environment puts between the two turns (chat-template markers)."""


def _recorded() -> tuple[dict[str, Any], np.ndarray]:
    """The recording and its routing rows ``[prompt + completion - 1, 48, 8]`` (int32 wire)."""
    record = load("moe_routed_experts.json")
    meta = record["response"]["meta_info"]
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4")
    return record, rows.reshape(-1, record["num_hidden_layers"], record["num_experts_per_tok"])


def _output(
    record: dict[str, Any], ids: list[int], prompt: int, rows: np.ndarray, wire: str
) -> dict[str, Any]:
    """A ``/generate`` output in SGLang's format with these ids and routing rows."""
    out = copy.deepcopy(record["response"])
    meta = out["meta_info"]
    out["output_ids"] = ids
    meta["prompt_tokens"], meta["completion_tokens"] = prompt, len(ids)
    meta.pop("output_token_logprobs", None)
    meta["routed_experts"] = base64.b64encode(rows.astype(wire).tobytes()).decode()
    meta["routed_experts_dtype"] = {"<i4": "int32", "u1": "uint8"}[wire]
    return out


def _written(store: TrajectoryStore) -> dict[str, np.ndarray]:
    """Three GRPO copies of the recording and two multi-turn episodes; per trajectory the
    routing every position should hold (the last token: experts 0..7)."""
    record, rows = _recorded()
    shape = (record["num_hidden_layers"], record["num_experts_per_tok"])
    writer = RolloutWriter(store, PayloadConfig(routing_shape=shape, num_experts=EXPERTS))
    prompt = tuple(record["request"]["input_ids"])
    output_ids = record["response"]["output_ids"]
    last = np.broadcast_to(np.arange(shape[1]), (1, *shape))
    expected = {}
    for i in range(3):
        writer.add(RolloutRequest(f"g-{i}", "g", "math", 0, prompt), record["response"])
        expected[f"g-{i}"] = np.concatenate([rows, last]).astype(np.uint8)
    split = 9  # the first turn generates output_ids[:split], then a tool answers
    env_rows = np.random.default_rng(1).integers(0, EXPERTS, (len(ENVIRONMENT), *shape))
    first_end = len(prompt) + split  # tokens after turn one
    whole = np.concatenate([rows[:first_end], env_rows, rows[first_end:], last])
    for i in range(2):
        request = RolloutRequest(f"a-{i}", "a", "agent", 0, prompt)
        turn_one = _output(record, output_ids[:split], len(prompt), whole[: first_end - 1], "<i4")
        writer.add_turn(request, turn_one)
        writer.add_environment(request, ENVIRONMENT)
        start = first_end - 1  # turn one never forwarded its last token; turn two's prefill did
        second_prompt = first_end + len(ENVIRONMENT)
        turn_two = _output(record, output_ids[split:], second_prompt, whole[start:-1], "u1")
        writer.add(request, turn_two, routed_experts_start=start)
        expected[f"a-{i}"] = whole.astype(np.uint8)
    return expected


def test_recorded_payloads_round_trip_bit_exactly() -> None:
    """Stored routing is uint8 [tokens, 48, 8] and equals SGLang's rows turn by turn."""
    store = TrajectoryStore(MemoryBackend())
    for tid, want in _written(store).items():
        got = store.read(UnitKey(tid, "routing"))
        assert got.dtype == np.uint8 and got.shape == want.shape, tid
        np.testing.assert_array_equal(got, want, err_msg=tid)


def test_a_turn_that_skips_positions_is_refused() -> None:
    """A second turn starting past the first turn's last forwarded position leaves positions
    unrouted: refused naming the trajectory and the positions."""
    record, rows = _recorded()
    shape = (record["num_hidden_layers"], record["num_experts_per_tok"])
    writer = RolloutWriter(
        TrajectoryStore(MemoryBackend()), PayloadConfig(routing_shape=shape, num_experts=EXPERTS)
    )
    prompt = tuple(record["request"]["input_ids"])
    ids = record["response"]["output_ids"]
    request = RolloutRequest("gap", "a", "agent", 0, prompt)
    writer.add_turn(request, _output(record, ids[:9], len(prompt), rows[: len(prompt) + 8], "<i4"))
    end = len(prompt) + 9
    second = _output(record, ids[9:], end, rows[end + 2 :], "<i4")
    with pytest.raises(ValueError, match=rf"trajectory 'gap': positions \[{end - 1}, {end + 2}\)"):
        writer.add(request, second, routed_experts_start=end + 2)


@pytest.mark.parametrize(
    ("cp", "pp", "disk"),
    [(1, 1, False), (2, 1, False), (2, 2, False), (2, 2, True)],
    ids=["cp1", "cp2", "cp2-pp2", "cp2-pp2-disk"],
)
def test_each_consumer_reads_exactly_its_tokens_routing(
    cp: int, pp: int, disk: bool, tmp_path: Path
) -> None:
    """DP2 x CP``cp`` x PP``pp``: each consumer (a (DP, CP) group's ring, one per pipeline stage
    with ``StageLayers``) packs its CP chunks' rows of its stage's layers, padding rows zero;
    the bytes each reads equal the rows it consumes x its layers x 8 (a 2-D read under PP, not
    a read-then-drop), no consumer reads the whole field, and every (token, layer) is read once.
    On a durable disk store the reads go unit by unit through ``TrajectoryStore.read_into``
    (2-D ``preadv`` reads, NOTE [ Batched disk reads ])."""
    store = TrajectoryStore(SafetensorsBackend(str(tmp_path)) if disk else MemoryBackend())
    expected = _written(store)
    ids = list(expected)
    layers = StageLayers(((0, 48),) if pp == 1 else ((0, 24), (24, 48)), ("routing",))
    plan = plan_minibatch(
        store.metas(ids),
        Topology(dp=2, cp=cp),
        PlannerConfig(
            token_fields=("routing",), scalar_fields=(), min_micro_batches=2, stage_layers=layers
        ),
    )
    schema = store.schema(ids[0])
    total = sum(len(v) for v in expected.values()) * 48 * 8
    seen = {tid: np.zeros((len(v), 48), dtype=int) for tid, v in expected.items()}
    for consumer in plan.stage_consumers(pp):
        first, last = layers.ranges[consumer.stage or 0]
        row_bytes = (last - first) * 8
        before = store.backend.bytes_read
        consumed = 0
        for mb in consumer.micro_batches:
            layout = pack_layout(mb, schema)
            buffer = np.empty(layout.nbytes, np.uint8)
            if disk:
                routing = pack_into(mb, layout, buffer, store.read_into)["routing"]
            else:
                routing = pack_into_batched(mb, layout, buffer, store.backend.read_many)["routing"]
            assert routing.shape[1:] == (last - first, 8), consumer.name
            at = 0
            for seq in mb.sequences:
                for start, stop in seq.chunks:
                    rows = routing[at : at + stop - start]
                    real = max(0, min(stop, seq.num_tokens) - start)
                    want = expected[seq.trajectory_id][start : start + real, first:last]
                    np.testing.assert_array_equal(rows[:real], want)
                    assert not rows[real:].any(), "padding rows must be zero"
                    seen[seq.trajectory_id][start : start + real, first:last] += 1
                    consumed += real * row_bytes
                    at += stop - start
        read = store.backend.bytes_read - before
        assert read == consumed < total, (consumer.name, read, consumed, total)
    assert all((count == 1).all() for count in seen.values()), "every token read exactly once"
