"""MoE routing as a stored per-token field: its name, dtype and the checks every reader shares."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from knitkit.storage.planning import StageLayers

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

ROUTING_FIELD = "routing"
"""Per-token field of the experts each MoE layer routed a token to: ``[tokens, layers, topk]``."""

# NOTE [ Routing of unrouted positions ]: SGLang reports each token's routed experts for
# positions [routed_experts_start, seqlen - 1): the last token is never forwarded. The stored
# field has a row for EVERY token (the planner CP-splits and packs it like the tokens, and the
# trainer's router sees every packed position), and a uint8 row has no spare value to mark
# "not routed" once a model has 256 experts (DeepSeek-V3). So:
# - the last token's row is experts 0..topk-1 (distinct, in range): it predicts nothing (its
#   loss mask is 0, NOTE [ Next-token alignment ]) and no later token attends to it, so its
#   experts reach neither the loss nor any gradient (only an auxiliary load-balancing loss
#   counts it, as it would count the trainer's own choice);
# - any other position without a reported row is refused when the trajectory is built: a
#   prompt position before the first turn's routed_experts_start, or a gap between turns
#   (a turn's routed_experts_start past the previous turn's last forwarded position). Replaying
#   routing for some tokens and not others would train a mixture of the rollout's and the
#   trainer's routings without saying so; send routed_experts_start_len = 0 on the first turn
#   and at most the tokens already reported on the next ones.
# Padding rows that packing adds are zero (expert 0 repeated): padded positions are masked out
# of the loss and attended by nothing, like the last token.


def routing_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned dtype holding expert ids ``0..num_experts-1`` (uint8 up to 256)."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be an int >= 1")
    for dtype in (np.uint8, np.uint16, np.uint32):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"num_experts={num_experts} does not fit a uint32 expert id")


def check_expert_ids(ids: np.ndarray, num_experts: int, *, where: str) -> None:
    """Every id of ``ids`` is an expert of the model; ``ValueError`` naming ``where`` otherwise."""
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_experts:
        bad = low if low < 0 else high
        raise ValueError(
            f"{where}: expert id {bad} is outside [0, {num_experts}); check num_experts against "
            "the MoE model's config (num_experts / n_routed_experts)"
        )


def stage_layers(
    config: TransformerConfig, fields: tuple[str, ...] = (ROUTING_FIELD,)
) -> StageLayers:
    """Each pipeline stage's decoder layers as megatron-core builds them (its
    ``get_transformer_layer_offset`` and ``get_num_layers_to_build`` at every ``pp_rank``), for
    ``PlannerConfig(stage_layers=...)``: each stage's ring then reads only its layers of
    ``fields`` (NOTE [ One ring per pipeline stage ] in knitkit/storage/planning/plan.py).
    ``RoutingReplay`` checks its routers against the stage's range. ``ValueError`` under
    virtual (interleaved) pipelining or a custom ``pipeline_model_parallel_layout``: a stage's
    layers are then not one contiguous range."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if config.virtual_pipeline_model_parallel_size or config.pipeline_model_parallel_layout:
        raise ValueError(
            "stage_layers: under virtual pipelining or a pipeline_model_parallel_layout a "
            "stage's layers are not one contiguous range; leave PlannerConfig.stage_layers unset "
            "(every stage then reads every layer)"
        )
    ranges = []
    for stage in range(config.pipeline_model_parallel_size):
        start = int(get_transformer_layer_offset(config, pp_rank=stage))
        ranges.append((start, start + int(get_num_layers_to_build(config, pp_rank=stage))))
    return StageLayers(tuple(ranges), fields)
