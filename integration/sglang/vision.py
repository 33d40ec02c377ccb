"""A trajectory's images and videos: stored units at their placeholder runs, and Qwen-VL mRoPE positions."""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from knitkit.integration.megatron.mrope import Grid, mrope_positions, placeholder_runs
from knitkit.storage import MultimodalInput

if TYPE_CHECKING:
    from .trajectory import PayloadConfig


@runtime_checkable
class DecodedImage(Protocol):
    """A decoded image such as ``PIL.Image.Image`` (what verl's in-process loop passes): anything
    ``np.asarray`` turns into pixels through ``__array_interface__``."""

    @property
    def __array_interface__(self) -> dict[str, object]: ...


ImageInput = bytes | str | np.ndarray | DecodedImage
"""An image as the request sent it: raw bytes, a ``data:`` URI, a file path, a URL, base64 text,
a numpy pixel array or a decoded image (PIL)."""

VideoInput = bytes | str | np.ndarray
"""A video as the request's ``video_data`` sent it: raw bytes, a ``data:`` URI, a file path, a URL,
or decoded frames ``[frames, H, W, C]``."""


@dataclass(frozen=True, slots=True)
class VisionInputs:
    """Every image and video of one trajectory, in the order of their placeholder runs."""

    images: tuple[ImageInput, ...] = ()
    image_grid_thw: tuple[Grid, ...] = ()
    videos: tuple[VideoInput, ...] = ()
    video_grid_thw: tuple[Grid, ...] = ()
    second_per_grid_ts: tuple[float, ...] = ()

    @property
    def has_grids(self) -> bool:
        """Qwen-VL inputs: the trajectory stores ``mrope_position_ids``."""
        return bool(self.image_grid_thw or self.video_grid_thw)

    def check(self, tid: str) -> None:
        """Grids, when given, come one per image / video the request sent."""
        for kind, data, grids in (
            ("image", self.images, self.image_grid_thw),
            ("video", self.videos, self.video_grid_thw),
        ):
            if grids and len(grids) != len(data):
                raise ValueError(
                    f"trajectory {tid!r}: {len(grids)} {kind}_grid_thw for {len(data)} {kind}s; "
                    f"pass the processor's {kind}_grid_thw, one (t, h, w) per {kind} sent"
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


def multimodal_inputs(
    tid: str, tokens: np.ndarray, vision: VisionInputs, config: PayloadConfig
) -> tuple[MultimodalInput, ...]:
    """One unit per image and per video placeholder run; equal inputs give equal (content) keys.

    A Qwen3-VL video spans one run per temporal patch (see NOTE [ Qwen-VL mRoPE positions ]):
    ``PayloadConfig.encode_video`` must then return one entry per run along its first axis.
    """
    inputs: list[MultimodalInput] = []
    if vision.images:
        token = _token(tid, "image", config.image_token_id)
        runs = placeholder_runs(tokens, token)
        if len(runs) != len(vision.images):
            raise ValueError(
                f"trajectory {tid!r}: {len(vision.images)} images but {len(runs)} runs of "
                f"image_token_id={token} in its tokens"
            )
        for image, (start, count) in zip(vision.images, runs, strict=True):
            raw = image_bytes(image) if isinstance(image, bytes | str) else image_array(image)
            array = image_array(raw) if config.encode_image is None else config.encode_image(raw)
            inputs.append(MultimodalInput("image", array, start, count, cost=float(count)))
    if vision.videos:
        inputs += _video_inputs(tid, tokens, vision, config)
    return tuple(sorted(inputs, key=lambda item: item.token_start))


def _video_inputs(
    tid: str, tokens: np.ndarray, vision: VisionInputs, config: PayloadConfig
) -> list[MultimodalInput]:
    token = _token(tid, "video", config.video_token_id)
    runs = placeholder_runs(tokens, token)
    per_video = [1] * len(vision.videos)
    if config.mrope_scheme == "qwen3_vl":
        if len(vision.video_grid_thw) != len(vision.videos):
            raise ValueError(
                f"trajectory {tid!r}: {len(vision.videos)} Qwen3-VL videos need their "
                f"video_grid_thw (one run per temporal patch); got {len(vision.video_grid_thw)}"
            )
        per_video = [int(grid[0]) for grid in vision.video_grid_thw]
    if sum(per_video) != len(runs):
        raise ValueError(
            f"trajectory {tid!r}: {len(vision.videos)} videos make {sum(per_video)} placeholder runs "
            f"(mrope_scheme={config.mrope_scheme!r}) but its tokens hold {len(runs)} runs of "
            f"video_token_id={token}"
        )
    inputs, first = [], 0
    for index, (video, count) in enumerate(zip(vision.videos, per_video, strict=True)):
        raw = image_bytes(video) if isinstance(video, bytes | str) else image_array(video)
        array = image_array(raw) if config.encode_video is None else config.encode_video(raw)
        if count > 1 and (config.encode_video is None or array.shape[0] != count):
            raise ValueError(
                f"trajectory {tid!r}, video {index}: it spans {count} placeholder runs (one per "
                "temporal patch); set PayloadConfig.encode_video to return an array with one "
                f"entry per temporal patch along its first axis (got shape {array.shape})"
            )
        for k, (start, length) in enumerate(runs[first : first + count]):
            unit = array if count == 1 else array[k : k + 1]
            inputs.append(MultimodalInput("video", unit, start, length, cost=float(length)))
        first += count
    return inputs


def mrope_field(
    tid: str, tokens: np.ndarray, vision: VisionInputs, config: PayloadConfig
) -> np.ndarray:
    """``[T, 3]`` mRoPE positions of the whole sequence (prompt, generated and environment tokens)."""
    if config.image_token_id is None:
        raise ValueError(
            f"trajectory {tid!r} has Qwen-VL grids; set PayloadConfig.image_token_id (and "
            "video_token_id with videos)"
        )
    try:
        positions = mrope_positions(
            tokens,
            vision.image_grid_thw,
            image_token_id=config.image_token_id,
            spatial_merge_size=config.spatial_merge_size,
            video_grid_thw=vision.video_grid_thw,
            video_token_id=config.video_token_id,
            second_per_grid_ts=vision.second_per_grid_ts,
            tokens_per_second=config.tokens_per_second,
            scheme=config.mrope_scheme,
        )
    except ValueError as error:
        raise ValueError(f"trajectory {tid!r}: {error}") from None
    return np.ascontiguousarray(positions.T)


def _token(tid: str, kind: str, token: int | None) -> int:
    if token is None:
        raise ValueError(f"trajectory {tid!r} has {kind}s; set PayloadConfig.{kind}_token_id")
    return token
