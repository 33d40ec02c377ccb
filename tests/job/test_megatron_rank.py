"""The Megatron per-rank handle in a real gloo world (DP2 x TP2, 4 processes) fed by a real Driver.

The driver runs in the test process (as on global rank 0 of a job); its ``RankSpec`` reaches
rank 0 as JSON and every other rank through ``broadcast_rank_spec`` (UTF-8 in a uint8 tensor).
Each rank builds ``MegatronRank.from_parallel_state(spec)`` and runs every pass through
``DedupVLMStep.run`` with ``get_forward_backward_func()``: a forward-only pass computes per-token
log-probs of the example's tiny VLM (``examples/megatron_wrap.py``) and writes them back with
``write_back_outputs`` (the first mini-batch) or as each is computed (``writing_back``, the
second); the train pass reads them back through the store in its batches.
Exactness: the train pass's ``old_logprobs`` must equal, bit for bit, what the forward-only pass
computed for the same micro-batch (packing from the store is the exact inverse of the driver's
unpacking, ``tests/job/test_unpack.py``), on both TP ranks of each group.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dist import World
from job_harness import wait_freed

from knitkit.admission import build_controller
from knitkit.integration.megatron import DedupVLMStep, MegatronRank, megatron_batch
from knitkit.integration.megatron import cpu as megatron_cpu
from knitkit.job import Driver, Output, Pass, RankSpec, broadcast_rank_spec
from knitkit.storage import EncoderTopology, PlannerConfig, Topology

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import megatron_wrap as user

PASSES = (
    Pass(
        "old", reads=("tokens",), writes=(Output("old_logprobs"),), forward_only=True, encodes=True
    ),
    Pass("train", reads=("tokens", "old_logprobs"), encodes=True),
)


def _logprob_step(
    data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    """The user's forward step of a log-prob pass: per-token log-probs of the labels."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], batch["labels"])

    def loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return output.sum(), {"logprobs": -output.detach().float().reshape(-1)}

    return output, loss


def _job(rank: int, spec_json: str) -> dict[str, Any]:
    """One rank of the job: every pass the driver serves, through ``DedupVLMStep``; also the
    threads its batches were converted on (``"threads"``) and its passes (``"passes"``)."""
    megatron_cpu.initialize_model_parallel(tensor_parallel=2)
    megatron_cpu.install_schedule_shim()
    try:
        spec = broadcast_rank_spec(RankSpec.from_json(spec_json) if rank == 0 else None)
        model = user.build_model(False)
        vision = model.module.vision
        threads: set[str] = set()

        def to_batch(micro_batch: Any) -> Mapping[str, object]:
            threads.add(threading.current_thread().name)
            return megatron_batch(micro_batch, cp_size=1, attention_mask=True)

        seen: dict[str, Any] = {"old": {}, "train": {}}
        step = DedupVLMStep(model, vision="vision")
        received: list[list[float]] = []
        passes = 0

        def train_step(data_iterator: Any, model: Any) -> Any:
            """The example's training forward step, noting the old log-probs it was given."""
            batch = next(data_iterator)
            received.append(batch["old_logprobs"].reshape(-1).tolist())
            return user.forward_step(iter([batch]), model)

        with MegatronRank.from_parallel_state(spec, to_batch=to_batch) as mrank:
            for work in mrank.passes():
                passes += 1
                received.clear()
                # the second mini-batch writes back each micro-batch as computed
                as_computed = work.forward_only and passes > 2
                forward = _logprob_step if work.forward_only else train_step
                if as_computed:
                    forward = work.writing_back(forward, {"old_logprobs": "logprobs"})
                with work:
                    model.zero_grad_buffer()
                    out = step.run(
                        forward_step_func=forward,
                        data_iterator=work.data_iterator(),
                        route=work.route,
                        encode_fn=work.encode_fn(vision.encode),
                        num_microbatches=work.num_micro_batches,
                        seq_length=user.MAX_SEQ,
                        micro_batch_size=1,
                        forward_only=work.forward_only,
                    )
                    if work.forward_only:
                        if not as_computed:
                            work.write_back_outputs(out, {"old_logprobs": "logprobs"})
                        for i, o in enumerate(out):
                            seen["old"][(work.minibatch_id, i)] = o["logprobs"].tolist()
                    else:
                        for i, values in enumerate(received):
                            seen["train"][(work.minibatch_id, i)] = values
        return seen | {"threads": sorted(threads), "passes": passes}
    finally:
        megatron_cpu.destroy_model_parallel()


def test_megatron_rank_writes_back_log_probs_the_train_pass_reads_bit_identical() -> None:
    """DP2 x TP2 on gloo: per-token log-probs of a forward-only pass land in the store exactly
    and the train pass receives them bit-identical on both TP ranks of each group; every
    admitted micro-batch is trained; the mini-batches are released after their last pass. Every
    batch is converted (``to_batch``) on a pass's prefetch thread, never on the training thread
    (NOTE [ Conversion on the prefetch thread ]), and the passes reuse their prefetch threads: a
    rank starts fewer than one per pass (NOTE [ One prefetch thread per rank ])."""
    data = [dataclasses.replace(t, source="s") for t in user.grpo_trajectories(seed=3)]
    controller = build_controller(
        "streaming", train_batch_size=len(data), num_minibatches=2, sources=["s"]
    )
    config = Driver.Config(
        passes=PASSES,
        topology=Topology(dp=2, cp=1, tp=2),
        encoders=(EncoderTopology("vision", dp=4),),
        planner=PlannerConfig(min_micro_batches=2),
        slot_bytes=1 << 20,
        schedule_slot_bytes=1 << 20,
        write_back_slot_bytes=1 << 16,
    )
    with config.build(admission=controller) as driver, World(4, timeout_s=300) as world:
        for trajectory in data:
            driver.write(trajectory)
        driver.finish()
        seen = world.run(_job, driver.rank_spec().to_json())
        driver.drain(120)
        assert driver.progress().released == 2
        wait_freed(driver.store)
    for rank in seen:
        assert rank["threads"], "no batch was converted"
        assert all(name.startswith("knitkit-microbatch-prefetch") for name in rank["threads"]), (
            rank["threads"]
        )
        assert len(rank["threads"]) < rank["passes"] == 4, rank["threads"]  # one per pass before
    # ranks 0, 1 are TP peers of DP rank 0 (megatron's order: TP fastest), 2, 3 of DP rank 1
    for writer, peer in ((0, 1), (2, 3)):
        old = seen[writer]["old"]
        assert old and set(old) == set(seen[writer]["train"]) == set(seen[peer]["train"])
        for key, values in old.items():
            assert np.array_equal(np.float32(values), np.float32(seen[writer]["train"][key])), key
            assert np.array_equal(np.float32(values), np.float32(seen[peer]["train"][key])), key
            assert np.isfinite(values).all() and np.any(np.float32(values) != 0), key
