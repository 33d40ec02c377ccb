"""Turn a request and its SGLang outputs into a storable ``Trajectory`` (payload arrays plus metadata)."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from knitkit.integration.megatron import MROPE_FIELD, mrope_positions
from knitkit.storage import MultimodalInput, Trajectory

from .response import GenerateOutput, parse_weight_version


@runtime_checkable
class DecodedImage(Protocol):
    """A decoded image such as ``PIL.Image.Image`` (what verl's in-process loop passes): anything
    ``np.asarray`` turns into pixels through ``__array_interface__``."""

    @property
    def __array_interface__(self) -> dict[str, object]: ...


ImageInput = bytes | str | np.ndarray | DecodedImage
"""An image as the request sent it: raw bytes, a ``data:`` URI, a file path, a URL, base64 text,
a numpy pixel array or a decoded image (PIL)."""


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
    image_grid_thw: tuple[tuple[int, int, int], ...] = ()
    """Qwen-VL: the processor's ``image_grid_thw`` (in patches), one per image. With it the
    trajectory stores ``mrope_position_ids`` ``[T, 3]`` over prompt and generated tokens, and each
    image's run must hold ``t * h * w / spatial_merge_size**2`` placeholders."""


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
    spatial_merge_size: int = 2
    """Qwen-VL's ``spatial_merge_size``: patches merged per image token along each side."""
    encode_image: Callable[[bytes | np.ndarray], np.ndarray] | None = None
    """Turns an image into the stored unit (e.g. patches): it gets the bytes of an encoded image
    and the pixel array of a decoded one (PIL, numpy); default: ``image_array``."""


def build_trajectory(
    request: RolloutRequest, segments: Sequence[GenerateOutput], config: PayloadConfig
) -> Trajectory:
    """Build one trajectory from its outputs: partial (aborted) segments first, the finished one last.

    A continued segment's prompt is the request's prompt plus every earlier segment's output
    (how slime and verl resume a partial rollout after a weight update). Per-token fields:
    ``tokens`` int32, ``loss_mask`` uint8 (1 on generated tokens), ``logprobs`` float32 (0 on the
    prompt), for MoE models ``routing`` ``[seq, layers, topk]`` and, for Qwen-VL requests with
    ``image_grid_thw``, ``mrope_position_ids`` ``[seq, 3]`` (``knitkit.integration.megatron``'s
    ``mrope_positions``, computed once here and never on the trainer).
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
    if request.image_grid_thw:
        fields[MROPE_FIELD] = _mrope(request, fields["tokens"], config)
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


def image_array(image: ImageInput) -> np.ndarray:
    """The stored unit of an image: the pixels of a decoded image (PIL, numpy), else its bytes as uint8.

    Units are content-addressed (bytes, dtype and shape), so equal pixels give one unit whether
    they came as a PIL image or an array; an encoded image and its decoded pixels are two units.
    """
    if isinstance(image, bytes | str):
        return np.frombuffer(image_bytes(image), dtype=np.uint8)
    return np.ascontiguousarray(np.asarray(image))


def image_bytes(image: bytes | str) -> bytes:
    """The bytes that identify an encoded image: decoded ``data:`` URIs, file contents, else the text."""
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


def _mrope(request: RolloutRequest, tokens: np.ndarray, config: PayloadConfig) -> np.ndarray:
    """``[T, 3]`` mRoPE positions of the whole sequence; each image's grid checked against its run."""
    tid, grids = request.trajectory_id, request.image_grid_thw
    if config.image_token_id is None:
        raise ValueError(f"trajectory {tid!r} has image_grid_thw; set PayloadConfig.image_token_id")
    runs = placeholder_runs(request.input_ids, config.image_token_id)
    if len(grids) != len(runs):
        raise ValueError(
            f"trajectory {tid!r}: {len(grids)} image_grid_thw for {len(runs)} images; "
            "pass the processor's image_grid_thw, one (t, h, w) per image"
        )
    merge = config.spatial_merge_size
    for i, ((t, h, w), (_, count)) in enumerate(zip(grids, runs, strict=True)):
        if t * h * w != count * merge**2:
            raise ValueError(
                f"trajectory {tid!r}, image {i}: grid {(t, h, w)} makes {t * h * w // merge**2} "
                f"tokens at spatial_merge_size={merge} but its placeholder run has {count}; "
                "send the processor-expanded input_ids with the same processor's image_grid_thw"
            )
    positions = mrope_positions(
        tokens, grids, image_token_id=config.image_token_id, spatial_merge_size=merge
    )
    return np.ascontiguousarray(positions.T)


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
        raw = image_bytes(image) if isinstance(image, bytes | str) else image_array(image)
        array = image_array(raw) if encode is None else encode(raw)
        inputs.append(MultimodalInput("image", array, start, count, cost=float(count)))
    return tuple(inputs)
