"""Turn a request and its SGLang outputs (one turn, or a multi-turn agent episode) into a storable ``Trajectory``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from knitkit.integration.megatron.mrope import MROPE_FIELD, Grid, MRopeScheme
from knitkit.integration.megatron.routing import ROUTING_FIELD, check_expert_ids, routing_dtype
from knitkit.storage import Trajectory

from .response import FinishReason, GenerateOutput, parse_weight_version
from .vision import ImageInput, VideoInput, VisionInputs, mrope_field, multimodal_inputs

# NOTE [ Multi-turn trajectories ]: an agent episode is ONE trajectory: the prompt, then assistant
# turns (each one SGLang /generate output) with the tokens the environment put between them (tool
# results, user or interaction turns, the chat template's turn markers). verl's tool agent loop
# (AgentLoopOutput: prompt_ids, response_ids, response_mask 1 on generated / 0 on tool and user
# tokens, response_logprobs 0.0 on them) and slime's multi-turn rollouts (Sample: tokens,
# loss_mask, rollout_log_probs over the response) build the same sequence. Here:
# - Each turn's request sends input_ids = everything so far (RolloutWriter.continuation_ids), so
#   SGLang's prompt_tokens must equal the tokens before the turn; a mismatch means the sequence
#   the engine saw is not the one stored (re-tokenised text, an image placeholder not expanded)
#   and is refused rather than stored misaligned.
# - loss_mask is 1 exactly on tokens the policy sampled, logprobs are each turn's
#   output_token_logprobs, 0 elsewhere; environment tokens are input only. The writer then shifts
#   once (see NOTE [ Next-token alignment ]): the last environment token predicts the next
#   turn's first token (trained), a turn's last token predicts the first environment token (not).
# - An aborted turn (a partial rollout) is continued by the next output before anything else; a
#   trajectory may end with environment tokens (verl's interaction loop ends on the user's last
#   message).
# - min_version/max_version cover every turn; MoE routing comes from the outputs, concatenated
#   turn by turn (each turn's rows start at its routed_experts_start; a later turn wins on the
#   prefix it re-reports; see NOTE [ Routing of unrouted positions ] for what is refused); images
#   the environment returned join the request's, in order of their placeholder runs.


@dataclass(frozen=True, slots=True)
class RolloutRequest:
    """What the rollout driver knows when it issues one trajectory's (first) request."""

    trajectory_id: str
    sample_id: str
    """The prompt (GRPO group); its ``n`` trajectories share its images."""
    source: str
    rollout_step: int
    input_ids: tuple[int, ...]
    """Prompt token ids, image placeholders already expanded (the processor's ``input_ids``)."""
    images: tuple[ImageInput, ...] = ()
    """The request's ``image_data``, in the order of their placeholder runs in ``input_ids``."""
    issued_version: int | None = None
    """Policy version when the request was issued; lowers ``min_version`` if older than the output's."""
    image_grid_thw: tuple[Grid, ...] = ()
    """Qwen-VL: the processor's ``image_grid_thw`` (in patches), one per image. With grids the
    trajectory stores ``mrope_position_ids`` ``[T, 3]`` over all its tokens (see NOTE
    [ Qwen-VL mRoPE positions ])."""
    videos: tuple[VideoInput, ...] = ()
    """The request's ``video_data``, in the order of their placeholders in ``input_ids``."""
    video_grid_thw: tuple[Grid, ...] = ()
    """Qwen-VL: the processor's ``video_grid_thw``, one per video."""
    second_per_grid_ts: tuple[float, ...] = ()
    """Qwen2.5-VL: the processor's ``second_per_grid_ts``, one per video."""


@dataclass(frozen=True, slots=True)
class EnvironmentTokens:
    """Tokens the environment put after an assistant turn (a tool result, a user turn, template
    markers): in the sequence, never trained; see NOTE [ Multi-turn trajectories ]."""

    token_ids: tuple[int, ...]
    images: tuple[ImageInput, ...] = ()
    """Images the environment returned (a screenshot), in the order of their runs in ``token_ids``."""
    image_grid_thw: tuple[Grid, ...] = ()
    """Qwen-VL: the processor's grids of ``images``."""


Segment = GenerateOutput | EnvironmentTokens
"""One piece of a trajectory after its prompt: an assistant output or environment tokens."""


@dataclass(kw_only=True, slots=True)
class PayloadConfig:
    """How SGLang outputs become stored fields."""

    image_token_id: int | None = None
    """Placeholder token of one image patch (e.g. Qwen2-VL's ``<|image_pad|>``); needed with images."""
    video_token_id: int | None = None
    """Placeholder token of one video patch (Qwen-VL's ``<|video_pad|>``); needed with videos."""
    routing_shape: tuple[int, int] | None = None
    """``(num_hidden_layers, num_experts_per_tok)`` of an MoE model returning routed experts."""
    num_experts: int | None = None
    """The MoE model's routed experts per layer (``num_experts``); needed with routed experts:
    ``routing`` is stored in the smallest unsigned dtype holding the ids (uint8 up to 256)."""
    version_of: Callable[[str], int] = parse_weight_version
    """Maps ``meta_info["weight_version"]`` to an integer policy version."""
    spatial_merge_size: int = 2
    """Qwen-VL's ``spatial_merge_size``: patches merged per image token along each side."""
    mrope_scheme: MRopeScheme = "qwen2_5_vl"
    """Qwen-VL generation: ``"qwen2_5_vl"`` or ``"qwen3_vl"`` (also Qwen3-VL-MoE), which lays out
    and times videos differently (see NOTE [ Qwen-VL mRoPE positions ])."""
    tokens_per_second: float | None = None
    """Qwen2.5-VL's ``vision_config.tokens_per_second`` (2 in the released checkpoints); needed
    with Qwen2.5-VL videos."""
    encode_image: Callable[[bytes | np.ndarray], np.ndarray] | None = None
    """Turns an image into the stored unit (e.g. patches): it gets the bytes of an encoded image
    and the pixel array of a decoded one (PIL, numpy); default: ``image_array``."""
    encode_video: Callable[[bytes | np.ndarray], np.ndarray] | None = None
    """Turns a video into the stored unit(s), like ``encode_image``; for a Qwen3-VL video (one
    placeholder run per temporal patch) its first axis must have one entry per temporal patch."""


def build_trajectory(
    request: RolloutRequest, segments: Sequence[Segment], config: PayloadConfig
) -> Trajectory:
    """Build one trajectory from what followed its prompt, in order (see NOTE [ Multi-turn trajectories ]).

    ``segments`` are SGLang outputs (an aborted one followed by its continuation; how slime and
    verl resume a partial rollout after a weight update) and ``EnvironmentTokens`` between turns.
    Per-token fields: ``tokens`` int32, ``loss_mask`` uint8 (1 on generated tokens), ``logprobs``
    float32 (0 elsewhere), for MoE models ``routing`` ``[seq, layers, topk]`` (``routing_dtype``)
    and, for Qwen-VL requests with grids, ``mrope_position_ids`` ``[seq, 3]`` (computed once
    here, never on the trainer).
    """
    tid = request.trajectory_id
    outputs = _check_order(tid, segments)
    tokens = list(request.input_ids)
    generated: list[tuple[int, GenerateOutput]] = []
    environment: list[EnvironmentTokens] = []
    for segment in segments:
        if isinstance(segment, EnvironmentTokens):
            environment.append(segment)
            tokens.extend(segment.token_ids)
            continue
        check_prompt_tokens(tid, segment, len(tokens))
        generated.append((len(tokens), segment))
        tokens.extend(segment.output_ids.tolist())
    fields: dict[str, np.ndarray] = {"tokens": np.asarray(tokens, dtype=np.int32)}
    fields["loss_mask"] = np.zeros(len(tokens), dtype=np.uint8)
    for start, output in generated:
        fields["loss_mask"][start : start + len(output.output_ids)] = 1
    logprobs = _logprobs(tid, len(tokens), generated)
    if logprobs is not None:
        fields["logprobs"] = logprobs
    routing = _routing(tid, len(tokens), outputs, config.num_experts)
    if routing is not None:
        fields[ROUTING_FIELD] = routing
    vision = VisionInputs(
        images=request.images + tuple(i for e in environment for i in e.images),
        image_grid_thw=request.image_grid_thw
        + tuple(g for e in environment for g in e.image_grid_thw),
        videos=request.videos,
        video_grid_thw=request.video_grid_thw,
        second_per_grid_ts=request.second_per_grid_ts,
    )
    vision.check(tid)
    if vision.has_grids:
        fields[MROPE_FIELD] = mrope_field(tid, fields["tokens"], vision, config)
    versions = [config.version_of(v) for s in outputs for v in (s.first_version, s.weight_version)]
    if request.issued_version is not None:
        versions.append(request.issued_version)
    return Trajectory(
        trajectory_id=tid,
        sample_id=request.sample_id,
        token_fields=fields,
        multimodal=multimodal_inputs(tid, fields["tokens"], vision, config),
        source=request.source,
        rollout_step=request.rollout_step,
        min_version=min(versions),
        max_version=max(versions),
    )


def segments_from_mask(
    response_ids: Sequence[int],
    response_mask: Sequence[int],
    response_logprobs: Sequence[float] | None = None,
    *,
    prompt_tokens: int,
    weight_version: str = "default",
    rid: str = "",
) -> list[Segment]:
    """A finished response as verl's ``AgentLoopOutput`` and slime's ``Sample`` hold it, as segments.

    ``response_ids`` are all tokens after the prompt, ``response_mask`` 1 where the policy
    generated them and 0 where the environment put them, ``response_logprobs`` one per response
    token (read only where the mask is 1). Each generated run becomes an output of
    ``weight_version`` (SGLang's string), each environment run ``EnvironmentTokens``; pass them
    to ``RolloutWriter.write`` (see NOTE [ Multi-turn trajectories ]).
    """
    ids = np.asarray(response_ids, dtype=np.int32).reshape(-1)
    mask = np.asarray(response_mask).reshape(-1)
    if len(mask) != len(ids) or not np.isin(mask, (0, 1)).all():
        raise ValueError(
            f"response {rid!r}: response_mask must be 0/1, one per response token "
            f"({len(mask)} for {len(ids)} ids)"
        )
    logprobs = None if response_logprobs is None else np.asarray(response_logprobs, np.float32)
    if logprobs is not None and len(logprobs) != len(ids):
        raise ValueError(
            f"response {rid!r}: {len(logprobs)} response_logprobs for {len(ids)} response_ids"
        )
    edges = [0, *(np.flatnonzero(np.diff(mask)) + 1).tolist(), len(ids)]
    segments: list[Segment] = []
    for turn, (a, b) in enumerate(itertools.pairwise(edges)):
        if b == a:
            continue
        if not mask[a]:
            segments.append(EnvironmentTokens(tuple(ids[a:b].tolist())))
            continue
        segments.append(
            GenerateOutput(
                rid=f"{rid}#{turn}",
                output_ids=ids[a:b],
                logprobs=None if logprobs is None else logprobs[a:b],
                routed_experts=None,
                routed_experts_start=0,
                finish=FinishReason("stop"),
                prompt_tokens=prompt_tokens + a,
                first_version=weight_version,
                weight_version=weight_version,
            )
        )
    return segments


def check_prompt_tokens(tid: str, output: GenerateOutput, expected: int) -> None:
    """The engine saw exactly the tokens before ``output`` (see NOTE [ Multi-turn trajectories ])."""
    if output.prompt_tokens != expected:
        raise ValueError(
            f"trajectory {tid!r}: output {output.rid!r} has prompt_tokens={output.prompt_tokens}, "
            f"expected {expected} (the prompt, earlier outputs and environment tokens); send "
            "input_ids = RolloutWriter.continuation_ids(request), placeholders expanded: "
            "re-tokenised text changes the tokens"
        )


def _check_order(tid: str, segments: Sequence[Segment]) -> list[GenerateOutput]:
    """The outputs, once each is finished or continued by the next output."""
    outputs = [s for s in segments if isinstance(s, GenerateOutput)]
    if not outputs:
        raise ValueError(f"trajectory {tid!r}: no SGLang output to build it from")
    for i, segment in enumerate(segments):
        if not isinstance(segment, GenerateOutput):
            continue
        if segment.finish is None:
            raise ValueError(
                f"trajectory {tid!r}: output {segment.rid!r} is still running; fold its stream "
                "with StreamAccumulator first"
            )
        after = segments[i + 1] if i + 1 < len(segments) else None
        if segment.finish.aborted and not isinstance(after, GenerateOutput):
            raise ValueError(
                f"trajectory {tid!r}: output {segment.rid!r} was aborted; continue it with "
                "input_ids = RolloutWriter.continuation_ids(request) before "
                + ("the environment's tokens" if after is not None else "building the trajectory")
            )
    return outputs


def _logprobs(
    tid: str, length: int, generated: list[tuple[int, GenerateOutput]]
) -> np.ndarray | None:
    have = [output.logprobs is not None for _, output in generated]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"trajectory {tid!r}: some outputs lack logprobs; set return_logprob=True")
    out = np.zeros(length, dtype=np.float32)
    for start, output in generated:
        assert output.logprobs is not None
        out[start : start + len(output.logprobs)] = output.logprobs
    return out


def _routing(
    tid: str, length: int, outputs: Sequence[GenerateOutput], num_experts: int | None
) -> np.ndarray | None:
    """Routing rows aligned with tokens, turn by turn (NOTE [ Routing of unrouted positions ])."""
    routed = [
        (s.routed_experts_start, s.routed_experts) for s in outputs if s.routed_experts is not None
    ]
    if not routed:
        return None
    if len(routed) != len(outputs):
        raise ValueError(
            f"trajectory {tid!r}: {len(outputs) - len(routed)} of its {len(outputs)} outputs "
            "have no routed_experts; send return_routed_experts=True on every turn"
        )
    if num_experts is None:
        raise ValueError(
            f"trajectory {tid!r}: SGLang returned routed_experts; set "
            "PayloadConfig(num_experts=...) (the model's routed experts per layer) so they are "
            "stored in the smallest dtype that holds them"
        )
    row_shape = routed[-1][1].shape[1:]
    if len(row_shape) != 2:
        raise ValueError(
            f"trajectory {tid!r}: routed_experts decoded without a routing shape; set "
            "PayloadConfig(routing_shape=(num_hidden_layers, num_experts_per_tok))"
        )
    out = np.empty((length, *row_shape), dtype=routing_dtype(num_experts))
    covered = 0  # positions [0, covered) hold reported rows
    for (start, rows), output in zip(routed, outputs, strict=True):
        if rows.shape[1:] != row_shape:
            raise ValueError(
                f"trajectory {tid!r}: output {output.rid!r} routes {list(rows.shape[1:])} per "
                f"token, the last output {list(row_shape)}; one model per trajectory"
            )
        if start > covered:
            raise ValueError(
                f"trajectory {tid!r}: positions [{covered}, {start}) have no routed experts "
                f"(output {output.rid!r} starts at routed_experts_start={start}); send "
                f"routed_experts_start_len <= {covered}: every position the trainer runs is "
                "replayed (NOTE [ Routing of unrouted positions ])"
            )
        check_expert_ids(rows, num_experts, where=f"trajectory {tid!r}, output {output.rid!r}")
        out[start : start + len(rows)] = rows
        covered = max(covered, start + len(rows))
    if covered < length - 1:
        raise ValueError(
            f"trajectory {tid!r}: routed experts cover positions [0, {covered}) of "
            f"{length}; SGLang reports every position but the last"
        )
    out[covered:] = np.arange(row_shape[1], dtype=out.dtype)
    return out
