"""Check that knitkit's dedup wrap of your Megatron VLM keeps the unwrapped gradients, on your layout.

Name your objects by import path and run it on every rank with torchrun (NCCL on GPUs, gloo on
CPU), e.g. ``torchrun --nproc-per-node 4 -m knitkit check-equivalence --provider
my_pkg.model:provider --forward-step my_pkg.model:forward_step --trajectories
my_pkg.data:trajectories --tp 2`` (DP = ranks / (TP x PP x CP)). Without torchrun it spawns the
ranks itself (``--nproc``, default TP x PP x CP). Rank 0 prints the per-parameter table and
writes the JSON report; the exit status is 0 only if the wrap is equivalent, and 2, before any
rank starts, when a callable breaks its contract (integration/megatron/README.md says what each
must take and return).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from knitkit.encoder_dedup import EquivalenceReport
from knitkit.integration.megatron.testing.contract import ContractError, check_contract
from knitkit.integration.megatron.testing.job import CheckJob, run_job
from knitkit.integration.megatron.testing.subject import VLMUnderTest
from knitkit.integration.megatron.testing.world import World, default_backend
from knitkit.sigterm import sigterm_exits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--provider", required=True, help="module:attr building this rank's DDP model"
    )
    parser.add_argument("--forward-step", required=True, help="module:attr, forward_step_func")
    parser.add_argument(
        "--trajectories", required=True, help="module:attr, trajectories or a function"
    )
    parser.add_argument("--vision", default="vision", help="dotted path of the vision path")
    parser.add_argument("--vision-extra", nargs="*", default=[], help="further vision modules")
    parser.add_argument(
        "--tp-sharded-vision", action="store_true", help="the vision path is TP-sharded"
    )
    parser.add_argument("--encoder", help="module:attr, model -> (unit input -> rows)")
    parser.add_argument("--to-batch", help="module:attr, megatron_batches' to_batch")
    parser.add_argument("--forward-only-step", help="module:attr, forward step of log-prob passes")
    parser.add_argument(
        "--reference-batches", help="module:attr, the unwrapped model's own batches"
    )
    parser.add_argument("--reference-forward-step", help="module:attr, with --reference-batches")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size")
    parser.add_argument("--steps", type=int, default=1, help="mini-batches (SGD update between)")
    parser.add_argument("--no-forward-only", action="store_true", help="skip the forward-only pass")
    parser.add_argument("--rtol", type=float, help="relative tolerance (default: per dtype)")
    parser.add_argument("--floor", type=float, help="smallest max|g_ref| compared relatively")
    parser.add_argument("--nproc", type=int, help="ranks to spawn when not under torchrun")
    parser.add_argument("--python-path", nargs="*", default=[], help="folders to import from")
    parser.add_argument("--json", type=Path, default=Path("equivalence.json"), help="report file")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="bound on the whole check")


def run(args: argparse.Namespace) -> int:
    job = _job(args)
    try:  # before any rank starts: see integration/megatron/testing/contract.py
        _check_contract(job)
    except ContractError as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"knitkit check-equivalence: error: {error}", file=sys.stderr)
        return 2
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        report = _torchrun_rank(job, args.timeout_s)
        rank = dist.get_rank()
        dist.destroy_process_group()
    else:
        size = args.nproc or job.model_parallel
        # a SIGTERM leaves through `with World`, which ends the ranks (NOTE [ SIGTERM while child
        # processes are open ] in knitkit/sigterm.py)
        with sigterm_exits.held(), World(size, backend=default_backend(size)) as world:
            report, rank = world.run(run_job, job, timeout_s=args.timeout_s)[0], 0
    if rank == 0:
        print(report.table())
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(report.dumps())
        print(f"report: {args.json}")
    return 0 if report.ok else 1


def _job(args: argparse.Namespace) -> CheckJob:
    subject = VLMUnderTest(
        provider=args.provider,
        forward_step=args.forward_step,
        vision=args.vision,
        vision_extra=tuple(args.vision_extra),
        tp_sharded_vision=args.tp_sharded_vision,
        encoder=args.encoder,
        to_batch=args.to_batch,
        forward_only_step=args.forward_only_step,
        reference_batches=args.reference_batches,
        reference_forward_step=args.reference_forward_step,
    )
    return CheckJob(
        subject=subject,
        trajectories=args.trajectories,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        context_parallel=args.cp,
        rtol=args.rtol,
        floor=args.floor,
        steps=args.steps,
        forward_only=not args.no_forward_only,
        python_path=tuple(str(Path(p).resolve()) for p in args.python_path),
    )


def _check_contract(job: CheckJob) -> None:
    """The user's callables against their contract, in this process (its ``--python-path`` first)."""
    for folder in reversed(job.python_path):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    check_contract(job.subject, job.trajectories)


def _torchrun_rank(job: CheckJob, timeout_s: float) -> EquivalenceReport:
    """Join torchrun's world (its env:// rendezvous) and run the check on this rank."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: gloo on loopback
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return run_job(dist.get_rank(), job)
