"""Trajectory payloads and their split into atomic units (one per field, one per multimodal input)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from knitkit.storage.backends.validate import check_name, check_unit
from knitkit.types import MultimodalRef, TrajectoryMeta, UnitKey

TOKENS = "tokens"


def content_key(kind: str, data: np.ndarray) -> UnitKey:
    """Content-addressed key of a multimodal input: equal bytes, dtype and shape give equal keys."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{data.dtype.name}{list(data.shape)}".encode())
    digest.update(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
    return UnitKey(digest.hexdigest(), kind)


@dataclass(frozen=True, slots=True)
class MultimodalInput:
    """One image (a patch tensor) or one group of consecutive video frames: one atomic unit."""

    kind: str
    """"image" or "video" (the ``UnitKey.field`` of its unit)."""
    data: np.ndarray
    token_start: int
    """Position of its first placeholder token in the trajectory."""
    num_tokens: int
    cost: float = 0.0
    """Encoder cost estimate; 0 means "use the number of rows (patches) of ``data``"."""

    @property
    def key(self) -> UnitKey:
        return content_key(self.kind, self.data)

    def ref(self, key: UnitKey | None = None) -> MultimodalRef:
        cost = self.cost or float(self.data.shape[0] if self.data.ndim else 1)
        return MultimodalRef(key or self.key, self.token_start, self.num_tokens, cost)


def video_groups(
    frames: np.ndarray, frames_per_group: int, token_start: int, tokens_per_frame: int
) -> tuple[MultimodalInput, ...]:
    """Split a video ``[frames, patches, dim]`` into groups of consecutive frames, one unit each."""
    groups = []
    for first in range(0, frames.shape[0], frames_per_group):
        chunk = frames[first : first + frames_per_group]
        start = token_start + first * tokens_per_frame
        groups.append(MultimodalInput("video", chunk, start, chunk.shape[0] * tokens_per_frame))
    return tuple(groups)


@dataclass(slots=True)
class Trajectory:
    """One rollout's payload: per-token fields (``tokens`` required), scalars and multimodal inputs."""

    trajectory_id: str
    sample_id: str
    token_fields: Mapping[str, np.ndarray]
    """Each ``[num_tokens, ...]``: tokens, logprobs, loss_mask, routing ``[seq, layers, topk]``, ..."""
    scalars: Mapping[str, np.ndarray | np.generic | float | int] = field(default_factory=dict)
    multimodal: tuple[MultimodalInput, ...] = ()
    source: str = ""
    rollout_step: int = 0
    min_version: int = 0
    max_version: int = 0
    accepted: bool = True

    @property
    def num_tokens(self) -> int:
        return int(self.token_fields[TOKENS].shape[0])

    def units(self) -> dict[UnitKey, np.ndarray]:
        """The trajectory's own atomic units (multimodal units are keyed by content, see ``inputs``).

        Every unit passes the backends' shared validation (``check_unit``: names, dtype), so a
        bad trajectory fails here, before anything is stored. Raises ``ValueError`` /
        ``TypeError`` naming the trajectory and field when a name or dtype is invalid, a
        per-token field's length differs from ``tokens``'s, a multimodal input lies outside the
        trajectory's tokens, or a unit key would be ambiguous.
        """
        check_name("trajectory id", self.trajectory_id)
        if "/" in self.trajectory_id:
            raise ValueError(f"trajectory id {self.trajectory_id!r} may not contain '/'")
        if TOKENS not in self.token_fields:
            raise ValueError(f"trajectory {self.trajectory_id!r} has no {TOKENS!r} field")
        clash = set(self.token_fields) & set(self.scalars)
        if clash:
            raise ValueError(
                f"trajectory {self.trajectory_id!r}: {sorted(clash)} are both per-token and scalar"
            )
        out: dict[UnitKey, np.ndarray] = {}
        for name, array in self.token_fields.items():
            array = np.asarray(array)
            if array.ndim == 0 or array.shape[0] != self.num_tokens:
                raise ValueError(
                    f"trajectory {self.trajectory_id!r}: field {name!r} has shape {list(array.shape)}; "
                    f"per-token fields need {self.num_tokens} rows like {TOKENS!r}"
                )
            out[UnitKey(self.trajectory_id, name)] = array
        for name, value in self.scalars.items():
            out[UnitKey(self.trajectory_id, name)] = np.asarray(value)
        for index, item in enumerate(self.multimodal):
            end = item.token_start + item.num_tokens
            if item.token_start < 0 or item.num_tokens < 0 or end > self.num_tokens:
                raise ValueError(
                    f"trajectory {self.trajectory_id!r}: multimodal input {index} ({item.kind}) "
                    f"covers tokens [{item.token_start}, {end}) outside its {self.num_tokens} tokens"
                )
            try:
                check_unit(UnitKey("input", item.kind), item.data)
            except (TypeError, ValueError) as exc:
                raise type(exc)(
                    f"trajectory {self.trajectory_id!r}: multimodal input {index}: {exc}"
                ) from None
        return {key: check_unit(key, array) for key, array in out.items()}

    def inputs(self) -> dict[UnitKey, np.ndarray]:
        """The multimodal units by content key (the n trajectories of a sample yield the same keys)."""
        return {m.key: m.data for m in self.multimodal}

    def meta(self, keys: tuple[UnitKey, ...] | None = None) -> TrajectoryMeta:
        """Metadata for admission and planning (pass ``keys`` to reuse already-hashed input keys)."""
        keys = keys or tuple(m.key for m in self.multimodal)
        refs = tuple(m.ref(k) for m, k in zip(self.multimodal, keys, strict=True))
        return TrajectoryMeta(
            trajectory_id=self.trajectory_id,
            sample_id=self.sample_id,
            source=self.source,
            rollout_step=self.rollout_step,
            num_tokens=self.num_tokens,
            min_version=self.min_version,
            max_version=self.max_version,
            accepted=self.accepted,
            multimodal=refs,
        )
