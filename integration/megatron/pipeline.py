"""Pipeline parallelism (PP >= 2) for the dedup VLM step: where the encoder runs and who talks to whom.

NOTE [ Encoder under pipeline parallelism ]: the vision path lives in the first pipeline stage's
model chunk (megatron's ``pre_process`` chunk), so only that stage's ranks encode, serve cached
features and run the deferred encoder backward; later stages run megatron's schedule unchanged.
Encoding rows travel in the first stage's TP x DP x CP group (megatron's
``get_tensor_and_data_parallel_group(with_context_parallel=True)``), which at PP=1 is the world.
Every stage plans the same mini-batch (the planner is per (DP, CP) consumer, independent of the
stage) and must run the same number of micro-batches: a stage that runs fewer leaves its peers
waiting in a p2p send forever, so the counts are checked across the pipeline group first.
The deferred backward runs inside the wrapped ``finalize_model_grads_func``, which every
pipeline schedule calls once after its last backward (cool-down included), so it runs after the
schedule's backward steps and before the first stage's gradient reduction, as at PP=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """This rank's pipeline stage, read from megatron's ``parallel_state``."""

    size: int
    rank: int

    @classmethod
    def current(cls) -> PipelineStage:
        from megatron.core import parallel_state as ps

        return cls(
            ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        )

    @property
    def encodes(self) -> bool:
        """True on the first stage: the ranks that hold the vision path (see NOTE [ Encoder under pipeline parallelism ])."""
        return self.rank == 0


def stage_group() -> dist.ProcessGroup | None:
    """The ranks of this pipeline stage (TP x DP x CP); ``None`` (the world) at PP=1."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_and_data_parallel_group(with_context_parallel=True)


def check_microbatches_agree(num_microbatches: int) -> None:
    """Raise on every rank unless all pipeline stages run ``num_microbatches`` (a PP collective)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    counts = torch.tensor([num_microbatches, -num_microbatches], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=ps.get_pipeline_model_parallel_group())
    most, fewest = int(counts[0]), -int(counts[1])
    if most != fewest:
        raise ValueError(
            f"pipeline stages disagree on num_microbatches (between {fewest} and {most}; this "
            f"stage {num_microbatches}); every stage must run the same plan's "
            "plan.num_micro_batches"
        )
