"""SGLang outputs feed the driver without glue: ``RolloutWriter(driver)`` stores, admits, serves."""

from __future__ import annotations

import json
from pathlib import Path

from job_harness import grid, join, run_ranks, wait_freed

from knitkit.admission import build_controller
from knitkit.integration.sglang import PayloadConfig, RolloutRequest, RolloutWriter
from knitkit.job import Driver, Output, Pass
from knitkit.storage import EncoderTopology, Topology

DATA = Path(__file__).resolve().parents[1] / "integration" / "data" / "sglang"
IMAGE_PAD = 151655
PASSES = (
    Pass("old", reads=("tokens",), writes=(Output("old_lp"),), forward_only=True, encodes=True),
    Pass("train", reads=("tokens", "labels", "logprobs", "old_lp"), encodes=True),
)


def test_recorded_sglang_outputs_go_through_the_driver() -> None:
    """A recorded VLM GRPO batch (n=4 outputs, 2 images) written by ``RolloutWriter(driver)``:
    stored once per image, admitted as one GRPO group, served through both passes; the
    rollout's log-probs and the written-back outputs reach the train pass."""
    record = json.loads((DATA / "vlm_grpo_batch.json").read_text())
    body = record["request"]
    requests = [
        RolloutRequest(
            f"s0-{i}", "s0", "chart", 2, tuple(body["input_ids"][0]), tuple(body["image_data"][0])
        )
        for i in range(4)
    ]
    admission = build_controller(
        "knittrans", train_batch_size=4, num_minibatches=1, sources=["chart"], group_size=4
    )
    config = Driver.Config(
        passes=PASSES,
        topology=Topology(dp=2),
        encoders=(EncoderTopology("vision", dp=1),),
        slot_bytes=4 << 20,
        schedule_slot_bytes=1 << 20,
        write_back_slot_bytes=1 << 20,
    )
    with config.build(admission=admission) as driver:
        threads, seen = run_ranks(driver.rank_spec(), grid(2, 1, 1, 1))
        writer = RolloutWriter(driver, PayloadConfig(image_token_id=IMAGE_PAD))  # type: ignore[arg-type]
        metas = writer.add_batch(requests, record["response"])
        assert all(m is not None for m in metas)
        assert driver.minibatches() == ("tb0-mb0",)
        stored = list(driver.store.backend.keys())  # a backend's units, not a dict
        assert len([k for k in stored if k.field == "image"]) == 2
        driver.finish()
        driver.drain(120)
        join(threads)
        wait_freed(driver.store)
    assert [s.error for s in seen if s.error] == []
    assert [m for s in seen for m in s.mismatches] == []
    units = sorted(u for s in seen for u in s.units[("tb0-mb0", "train")])
    assert len(units) == 2 and all(u.endswith("/image") for u in units)
