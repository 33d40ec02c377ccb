"""Next-token alignment from the SGLang writer to megatron_batch (issue 10, failure 2; issue 22 item 17).

Position t predicts token t+1 (NOTE [ Next-token alignment ] in knitkit/next_token.py): through
writer -> store -> plan -> pack -> megatron_batch, with CP=1 and CP=2 (zigzag chunks cut the
sequences, so a shift made per chunk would pair the wrong tokens), every generated token is a
trained label exactly once, no prompt or environment (tool response) token is, and the rollout
log-prob at each loss position is the one SGLang returned for that label token. The plan mixes
single-turn GRPO trajectories with multi-turn tool-agent episodes (NOTE [ Multi-turn trajectories ]).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import test_sglang_multiturn as multiturn
from sglang_fixtures import load

from knitkit.integration.megatron import megatron_batch
from knitkit.integration.sglang import PayloadConfig, RolloutRequest, RolloutWriter
from knitkit.microbatch_iter import MicroBatchIterator, PackedMicroBatch
from knitkit.storage import (
    MemoryBackend,
    PlannerConfig,
    Topology,
    TrajectoryStore,
    pack,
    plan_minibatch,
)
from knitkit.storage.planning import SequenceSlice

IMAGE_PAD = 151655
FIELDS = ("tokens", "labels", "loss_mask", "logprobs")


def _written() -> tuple[TrajectoryStore, dict[str, tuple[list[int], dict[int, float]]]]:
    """A recorded GRPO batch and three copies of a recorded tool-agent episode through the
    writer; per trajectory: its tokens and {index of a generated token: its SGLang log-prob}."""
    record = load("vlm_grpo_batch.json")
    body = record["request"]
    store = TrajectoryStore(MemoryBackend())
    writer = RolloutWriter(store, PayloadConfig(image_token_id=IMAGE_PAD))
    expected = {}
    for i, raw in enumerate(record["response"]):
        prompt = tuple(body["input_ids"][0])
        request = RolloutRequest(f"s0-{i}", "s0", "chart", 2, prompt, tuple(body["image_data"][0]))
        writer.add(request, raw)
        logprobs = [entry[0] for entry in raw["meta_info"]["output_token_logprobs"]]
        generated = dict(enumerate(logprobs, start=len(prompt)))
        expected[request.trajectory_id] = ([*prompt, *raw["output_ids"]], generated)
    agent = load("multi_turn_tool_agent.json")
    for i in range(3):
        request = multiturn.request_for(agent, f"agent-{i}")
        multiturn.replay(writer, request, agent)
        generated = {at: lp for at, _, lp in multiturn.generated(agent)}
        expected[request.trajectory_id] = (multiturn.full_sequence(agent), generated)
    return store, expected


def _trained(
    sequences: Sequence[SequenceSlice], batch: Mapping[str, Any]
) -> Iterator[tuple[tuple[str, int], int, float]]:
    """((trajectory, token index), label, rollout log-prob) at every loss position of a batch."""
    at = 0
    for seq in sequences:
        piece = slice(at, at + seq.local_length)
        at += seq.local_length
        for position, mask, label, logprob in zip(
            batch["position_ids"][0, piece].tolist(),
            batch["loss_mask"][0, piece].tolist(),
            batch["labels"][0, piece].tolist(),
            batch["rollout_log_probs"][0, piece].tolist(),
            strict=True,
        ):
            if mask:  # position p predicts token p + 1
                yield (seq.trajectory_id, position + 1), label, logprob


@pytest.mark.parametrize("cp", [1, 2])
def test_every_generated_token_is_a_label_once_with_its_logprob(cp: int) -> None:
    """Each generated token is trained exactly once, at the position before it, with its own
    log-prob; prompt and tool-response tokens never are."""
    store, expected = _written()
    ids = list(expected)
    plan = plan_minibatch(
        store.metas(ids),
        Topology(dp=1, cp=cp, tp=1),
        PlannerConfig(token_fields=FIELDS, scalar_fields=(), min_micro_batches=2),
    )
    trained: dict[tuple[str, int], tuple[int, float]] = {}
    for cp_rank in range(cp):
        consumer = plan.consumer(0, cp_rank)
        schema = store.schema(ids[0])
        packed = [
            PackedMicroBatch(*pack(mb, schema, store.read_into)) for mb in consumer.micro_batches
        ]
        with MicroBatchIterator(packed) as iterator:
            for mb, micro_batch in zip(consumer.micro_batches, iterator, strict=True):
                batch = megatron_batch(micro_batch, cp_size=cp)
                for trained_here in _trained(mb.sequences, batch):
                    key, label, logprob = trained_here
                    assert key not in trained, f"token {key} trained twice"
                    trained[key] = (label, logprob)
    wanted = {
        (tid, t): (tokens[t], logprob)
        for tid, (tokens, generated) in expected.items()
        for t, logprob in generated.items()
    }
    assert set(trained) == set(wanted), (
        f"untrained generated tokens: {sorted(set(wanted) - set(trained))[:5]}; "
        f"trained non-generated: {sorted(set(trained) - set(wanted))[:5]}"
    )
    for key, (label, lp) in trained.items():
        assert label == wanted[key][0], (key, label, wanted[key])
        assert lp == pytest.approx(wanted[key][1], rel=1e-6), (key, lp, wanted[key])
