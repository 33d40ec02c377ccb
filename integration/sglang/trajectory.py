"""Turn a request and its SGLang outputs into a storable ``Trajectory`` (payload arrays plus metadata)."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from knitkit.storage import MultimodalInput, Trajectory

from .response import GenerateOutput, parse_weight_version

ImageInput = bytes | str
"""An image as the request sent it: raw bytes, a ``data:`` URI, a file path, a URL or base64 text."""


@dataclass(frozen=True, slots=True)
class RolloutRequest:
    """What the rollout driver knows when it issues one trajectory's request."""

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


@dataclass(kw_only=True, slots=True)
class PayloadConfig:
    """How SGLang outputs become stored fields."""

    image_token_id: int | None = None
    """Placeholder token of one image patch (e.g. Qwen2-VL's ``<|image_pad|>``); needed with images."""
    routing_shape: tuple[int, int] | None = None
    """``(num_hidden_layers, num_experts_per_tok)`` of an MoE model returning routed experts."""
    routing_dtype: str = "int16"
    """Stored dtype of the routing field; -1 marks positions SGLang did not route."""
    version_of: Callable[[str], int] = parse_weight_version
    """Maps ``meta_info["weight_version"]`` to an integer policy version."""
    encode_image: Callable[[bytes], np.ndarray] | None = None
    """Turns image bytes into the stored unit (e.g. patches); default: the bytes as uint8."""


def build_trajectory(
    request: RolloutRequest, segments: Sequence[GenerateOutput], config: PayloadConfig
) -> Trajectory:
    """Build one trajectory from its outputs: partial (aborted) segments first, the finished one last.

    A continued segment's prompt is the request's prompt plus every earlier segment's output
    (how slime and verl resume a partial rollout after a weight update). Per-token fields:
    ``tokens`` int32, ``loss_mask`` uint8 (1 on generated tokens), ``logprobs`` float32 (0 on the
    prompt) and, for MoE models, ``routing`` ``[seq, layers, topk]``.
    """
    tid = request.trajectory_id
    if not segments:
        raise ValueError(f"trajectory {tid!r}: no SGLang output to build it from")
    last = segments[-1]
    if last.finish is None or last.finish.aborted:
        raise ValueError(
            f"trajectory {tid!r}: last output is {'running' if last.finish is None else 'aborted'}; "
            "continue it with input_ids = prompt + outputs so far, then build"
        )
    if any(s.finish is None or not s.finish.aborted for s in segments[:-1]):
        raise ValueError(
            f"trajectory {tid!r}: only its last output may be finished; the others are aborted"
        )
    tokens = list(request.input_ids)
    generated: list[tuple[int, GenerateOutput]] = []
    for segment in segments:
        if segment.prompt_tokens != len(tokens):
            raise ValueError(
                f"trajectory {tid!r}: output {segment.rid!r} has prompt_tokens={segment.prompt_tokens}, "
                f"expected {len(tokens)} (prompt + earlier outputs); send expanded input_ids"
            )
        generated.append((len(tokens), segment))
        tokens.extend(segment.output_ids.tolist())
    fields: dict[str, np.ndarray] = {"tokens": np.asarray(tokens, dtype=np.int32)}
    fields["loss_mask"] = np.zeros(len(tokens), dtype=np.uint8)
    for start, segment in generated:
        fields["loss_mask"][start : start + len(segment.output_ids)] = 1
    logprobs = _logprobs(tid, len(tokens), generated)
    if logprobs is not None:
        fields["logprobs"] = logprobs
    routing = _routing(tid, len(tokens), segments, config.routing_dtype)
    if routing is not None:
        fields["routing"] = routing
    versions = [config.version_of(v) for s in segments for v in (s.first_version, s.weight_version)]
    if request.issued_version is not None:
        versions.append(request.issued_version)
    return Trajectory(
        trajectory_id=tid,
        sample_id=request.sample_id,
        token_fields=fields,
        multimodal=_images(request, config),
        source=request.source,
        rollout_step=request.rollout_step,
        min_version=min(versions),
        max_version=max(versions),
    )


def image_bytes(image: ImageInput) -> bytes:
    """The bytes that identify an image: decoded ``data:`` URIs, file contents, else the text itself."""
    if isinstance(image, bytes):
        return image
    if image.startswith("data:"):
        return base64.b64decode(image.partition(",")[2])
    if os.path.isfile(image):
        with open(image, "rb") as file:
            return file.read()
    return image.encode()  # a URL or bare base64: the same text names the same image


def placeholder_runs(input_ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every maximal run of ``token_id`` in ``input_ids``."""
    ids = np.asarray(input_ids)
    mask = np.concatenate(([False], ids == token_id, [False]))
    edges = np.flatnonzero(mask[1:] != mask[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _logprobs(
    tid: str, length: int, generated: list[tuple[int, GenerateOutput]]
) -> np.ndarray | None:
    have = [segment.logprobs is not None for _, segment in generated]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"trajectory {tid!r}: some outputs lack logprobs; set return_logprob=True")
    out = np.zeros(length, dtype=np.float32)
    for start, segment in generated:
        assert segment.logprobs is not None
        out[start : start + len(segment.logprobs)] = segment.logprobs
    return out


def _routing(
    tid: str, length: int, segments: Sequence[GenerateOutput], dtype: str
) -> np.ndarray | None:
    """Routing rows aligned with tokens; each response covers the whole stream, so later wins."""
    routed = [
        (s.routed_experts_start, s.routed_experts) for s in segments if s.routed_experts is not None
    ]
    if not routed:
        return None
    last = segments[-1].routed_experts
    if last is None:
        raise ValueError(f"trajectory {tid!r}: the last output has no routed_experts")
    out = np.full((length, *last.shape[1:]), -1, dtype=dtype)
    for start, rows in routed:
        if rows.size and int(rows.max()) > np.iinfo(out.dtype).max:
            raise ValueError(f"trajectory {tid!r}: expert id {int(rows.max())} overflows {dtype}")
        out[start : start + len(rows)] = rows
    return out


def _images(request: RolloutRequest, config: PayloadConfig) -> tuple[MultimodalInput, ...]:
    """One unit per image, at its placeholder run; equal images give equal (content) keys."""
    if not request.images:
        return ()
    if config.image_token_id is None:
        raise ValueError(
            f"trajectory {request.trajectory_id!r} has images; set PayloadConfig.image_token_id"
        )
    runs = placeholder_runs(request.input_ids, config.image_token_id)
    if len(runs) != len(request.images):
        raise ValueError(
            f"trajectory {request.trajectory_id!r}: {len(request.images)} images but {len(runs)} runs "
            f"of image_token_id={config.image_token_id} in input_ids"
        )
    encode = config.encode_image
    inputs = []
    for image, (start, count) in zip(request.images, runs, strict=True):
        data = image_bytes(image)
        array = np.frombuffer(data, dtype=np.uint8) if encode is None else encode(data)
        inputs.append(MultimodalInput("image", array, start, count, cost=float(count)))
    return tuple(inputs)
