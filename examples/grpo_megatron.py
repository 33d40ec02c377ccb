"""GRPO on megatron-core, fed by knitkit end to end: rollout stand-in -> driver -> per-rank handles -> passes.

A complete GRPO loop as a team plugs knitkit into it. Rank 0 hosts the driver (knittrans
admission with a source quota, the store, the reorganizer processes it spawns); a deterministic
rollout stand-in writes SGLang ``/generate`` outputs with images (8 responses per prompt)
through the SGLang adapter into it, with each response's reward and its group-normalised
advantage. Every rank builds the Megatron per-rank handle from ``parallel_state`` and runs each
step's passes: old log-probs and reference log-probs (forward-only, each unique image encoded
once per pass, outputs written back into the store), then the train pass: PPO-clipped loss with
a KL term to the frozen reference, and the optimizer step (megatron-core's Adam with CUDA; on the
CPU ``torch.optim.AdamW`` over ``main_grad``, see NOTE [ Optimizer on CPU ] in grpo/model.py).
Per-step figures go through ``knitkit.metrics`` (``--tensorboard DIR``).

``--checkpoint-dir DIR`` saves the model, the optimizer, the driver and the rollout at every
step boundary, atomically (``grpo/resume.py``); ``--resume`` continues from the newest complete
checkpoint there (after a crash: kill the job at any point, start it again with ``--resume``);
``--ledger DIR`` keeps the exactly-once ledger of what each DP group trained.

``--reference`` then runs the same loop without knitkit (``grpo/plain.py``: every rank loads
its share of the same admitted trajectories itself, no dedup, log-probs recomputed per pass) and
prints how far the two are apart; ``--json PATH`` writes both histories and that comparison.

``--serve SPEC --rank-nodes A,A,B,B`` runs only the driver, on a Ray cluster (``grpo/cluster.py``:
``RayControl`` relays and reorganizers on the ranks' nodes); ranks started with ``--spec-file
SPEC`` on other nodes (``torchrun --nnodes 2 ...``) train from it (tests/cluster/test_grpo_on_nodes.py).

Run: torchrun --standalone --nproc-per-node 4 examples/grpo_megatron.py
(DP2 x TP2: NCCL on 4 GPUs; without CUDA gloo on the CPU, see ``megatron_common.megatron_world``.)
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import megatron_common as common
import torch
import torch.distributed as dist
from grpo.compare import Check, Comparison, compare, snapshot
from grpo.config import GRPOConfig
from grpo.knit import knitkit_loop
from grpo.model import build_models, build_optimizer
from grpo.plain import plain_loop
from grpo.resume import Checkpointing
from grpo.train import StepRecord, Trainer
from megatron_wrap import MAX_SEQ

from knitkit.integration.megatron import MegatronLayout
from knitkit.job.checkpoint import CheckpointDir, write_file
from knitkit.metrics import FanOut, MetricsObserver, TensorBoardObserver

TENSOR_PARALLEL = 2


def new_trainer(run: GRPOConfig, keep_gradients: bool = False) -> Trainer:
    """A fresh policy (seeded: the same weights on every call), its reference and optimizer;
    ``keep_gradients`` keeps each step's reduced gradients for the comparison."""
    policy, reference = build_models()
    return Trainer(
        policy=policy,
        reference=reference,
        optimizer=build_optimizer(policy, run.optim),
        loss=run.loss,
        seq_length=MAX_SEQ,
        epochs=run.ppo_epochs,
        gradients=[] if keep_gradients else None,
    )


def print_step(step: int, metrics: Mapping[str, float]) -> None:
    grpo = {k.removeprefix("knitkit/grpo/"): v for k, v in metrics.items()}
    print(
        f"step {step}: loss {grpo['loss']:+.6f}, kl {grpo['kl']:.6f}, nll {grpo['nll']:.4f}, "
        f"reward {grpo['reward']:.3f}, clipped {grpo['clipped']:.3f}, "
        f"images encoded {grpo['images_encoded']:.0f}",
        flush=True,
    )


def print_comparison(result: Comparison) -> None:
    for name in ("figures", "gradients", "parameters"):
        check: Check = getattr(result, name)
        print(
            f"plain loop, {name}: max |diff| {check.max_abs:.2e} (largest |ref| "
            f"{check.reference_max:.2e}), max rel {check.max_rel:.2e} over {check.checked} values "
            f"above {check.tolerance.floor:g}",
            flush=True,
        )
    verdict = "equal within tolerance" if result.ok else "DIFFERENT"
    print(f"plain loop: same trajectories {result.same_trajectories}, {verdict}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (mini-batches)")
    parser.add_argument(
        "--reference", action="store_true", help="also run the plain loop and compare"
    )
    parser.add_argument("--json", type=Path, help="rank 0 writes the histories here")
    parser.add_argument("--checkpoint-dir", type=Path, help="checkpoint at every step boundary")
    parser.add_argument(
        "--checkpoint-every", type=int, default=1, help="save every N optimizer steps"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--ledger", type=Path, help="exactly-once ledger directory")
    parser.add_argument(
        "--final-params", type=Path, help="every rank saves its final policy here (rank<r>.pt)"
    )
    parser.add_argument("--moe", action="store_true", help="MoE policy with routing replay")
    parser.add_argument(
        "--serve",
        type=Path,
        help="run only the driver (on a Ray cluster), writing the ranks' spec to this file",
    )
    parser.add_argument(
        "--rank-nodes", help="with --serve: the node address of each rank, comma-separated"
    )
    parser.add_argument(
        "--spec-file", type=Path, help="ranks: take the spec a --serve driver wrote, host none"
    )
    common.tensorboard_argument(parser)
    args = parser.parse_args()
    if args.moe:  # grpo/moe.py: a megatron-core MoE GPTModel trained with R3
        from grpo.moe import moe_main

        moe_main(args.steps)
        return
    if (args.resume or args.ledger) and not args.checkpoint_dir:
        parser.error("--resume and --ledger need --checkpoint-dir")
    if args.resume and args.reference:
        parser.error("--reference compares an uninterrupted run: leave out --resume")
    run = GRPOConfig(steps=args.steps)
    if args.serve:  # grpo/cluster.py: the driver alone, its ranks on other nodes
        from grpo.cluster import serve

        serve(run, args.serve, args.rank_nodes.split(","), TENSOR_PARALLEL)
        return
    checkpoint = (
        Checkpointing(
            CheckpointDir(args.checkpoint_dir),
            every=args.checkpoint_every,
            resume=args.resume,
            ledger_dir=args.ledger,
        )
        if args.checkpoint_dir
        else None
    )
    with common.megatron_world(tensor_parallel=TENSOR_PARALLEL), ExitStack() as stack:
        observers: list[MetricsObserver] = []
        if dist.get_rank() == 0:
            observers.append(print_step)
            if args.tensorboard:
                observers.append(stack.enter_context(TensorBoardObserver(args.tensorboard)))
        trainer = new_trainer(run, keep_gradients=args.reference)
        initial = snapshot(trainer.policy)
        spec = None
        if args.spec_file:
            from grpo.cluster import check_layout, read_spec

            spec = read_spec(args.spec_file)
            check_layout(spec, MegatronLayout.from_parallel_state())
        history = knitkit_loop(run, trainer, FanOut(*observers), checkpoint=checkpoint, spec=spec)
        if args.final_params:
            args.final_params.mkdir(mode=0o700, parents=True, exist_ok=True)
            buffer = io.BytesIO()
            torch.save(trainer.policy.state_dict(), buffer)
            write_file(args.final_params / f"rank{dist.get_rank()}.pt", buffer.getvalue())
        report: dict[str, object] = {"knitkit": _records(history)}
        if args.reference:
            plain = new_trainer(run, keep_gradients=True)
            minibatches = [record.trajectory_ids for record in history]
            plain_history = plain_loop(run, plain, minibatches)
            result = compare(
                history,
                plain_history,
                (trainer.gradients or [], plain.gradients or []),
                initial,
                (snapshot(trainer.policy), snapshot(plain.policy)),
            )
            report |= {"plain": _records(plain_history), "comparison": result.as_dict()}
            if dist.get_rank() == 0:
                print_comparison(result)
        if args.json and dist.get_rank() == 0:
            args.json.write_text(json.dumps(report, indent=1))


def _records(history: list[StepRecord]) -> list[dict[str, object]]:
    return [asdict(record) for record in history]


if __name__ == "__main__":
    main()
