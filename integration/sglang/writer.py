"""Streaming rollout into a store: each finished SGLang output becomes a stored trajectory."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from knitkit.next_token import next_token_fields
from knitkit.storage import Trajectory
from knitkit.types import TrajectoryMeta

from .response import GenerateOutput, parse_generate_output
from .trajectory import (
    EnvironmentTokens,
    PayloadConfig,
    RolloutRequest,
    Segment,
    build_trajectory,
    check_prompt_tokens,
)
from .vision import ImageInput


class TrajectorySink(Protocol):
    """Where finished trajectories go: a ``knitkit.storage.TrajectoryStore``, a
    ``knitkit.job.Driver`` (which also reports each one to admission), or on a node other than
    the driver's a ``knitkit.storage.UnitPlacer`` (units stay on this node; the driver adopts
    the record it sends)."""

    def write(self, trajectory: Trajectory) -> TrajectoryMeta: ...


class RolloutWriter:
    """Writes each finished trajectory to the store as it completes and returns its admission metadata.

    Stored fields follow the next-token convention (``knitkit.next_token``): ``tokens`` and
    ``routing`` at their token; ``labels``, ``loss_mask`` and ``logprobs`` at the position that
    predicts the token (position t predicts token t+1), ready for a CP split.

    An aborted output (a partial rollout, e.g. paused for a weight update) is held until the
    request is continued with ``continuation_ids(request)`` and finishes; the trajectory then
    spans every segment and its ``min_version``/``max_version`` cover all of them. A multi-turn
    episode is held the same way: ``add_turn`` for each assistant turn that the environment
    answers, ``add_environment`` for its tokens, ``add`` for the last turn (or ``finish`` when
    the episode ends on environment tokens); see NOTE [ Multi-turn trajectories ].

    Not thread-safe: feed it from the one loop that collects the rollout's outputs.
    """

    def __init__(self, store: TrajectorySink, config: PayloadConfig | None = None) -> None:
        self.store = store
        self.config = config or PayloadConfig()
        self._held: dict[str, list[Segment]] = {}

    def add(
        self,
        request: RolloutRequest,
        output: GenerateOutput | Mapping[str, Any],
        *,
        routed_experts_start: int = 0,
    ) -> TrajectoryMeta | None:
        """Add one output of ``request`` (parsed, or the raw ``/generate`` dict) that ends it.

        Returns the stored trajectory's metadata (report it to admission), or None when the output
        was aborted and the trajectory waits for its continuation.
        """
        output = self._hold(request, output, routed_experts_start)
        if output.finish is not None and output.finish.aborted:
            return None
        try:
            return self.finish(request)
        except (ValueError, KeyError):
            held = self._held[request.trajectory_id]
            held.pop()  # the trajectory is held as it was before this output
            if not held:
                del self._held[request.trajectory_id]
            raise

    def add_turn(
        self,
        request: RolloutRequest,
        output: GenerateOutput | Mapping[str, Any],
        *,
        routed_experts_start: int = 0,
    ) -> None:
        """Hold an assistant turn after which the episode goes on (the environment answers next)."""
        self._hold(request, output, routed_experts_start)

    def add_environment(
        self,
        request: RolloutRequest,
        token_ids: Sequence[int],
        *,
        images: Sequence[ImageInput] = (),
        image_grid_thw: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        """Hold the tokens the environment put after the last turn (a tool result, a user turn, the
        next turn's template markers): stored with the trajectory, never trained."""
        held = self._held.get(request.trajectory_id, [])
        last = held[-1] if held else None
        if last is None:
            raise ValueError(
                f"trajectory {request.trajectory_id!r}: environment tokens follow an assistant "
                "turn; add_turn(request, output) first (tokens before it belong in input_ids)"
            )
        if isinstance(last, GenerateOutput) and last.finish is not None and last.finish.aborted:
            raise ValueError(
                f"trajectory {request.trajectory_id!r}: output {last.rid!r} was aborted; continue "
                "it with continuation_ids(request) before the environment's tokens"
            )
        held.append(
            EnvironmentTokens(
                tuple(int(t) for t in token_ids),
                tuple(images),
                tuple((int(t), int(h), int(w)) for t, h, w in image_grid_thw),
            )
        )

    def finish(self, request: RolloutRequest) -> TrajectoryMeta:
        """Store the held episode of ``request`` (it may end with environment tokens)."""
        segments = self._held.get(request.trajectory_id)
        if not segments:
            raise KeyError(f"trajectory {request.trajectory_id!r} holds no output to store")
        meta = self.write(request, segments)
        del self._held[request.trajectory_id]
        return meta

    def write(self, request: RolloutRequest, segments: Sequence[Segment]) -> TrajectoryMeta:
        """Store a whole trajectory from its segments at once (e.g. ``segments_from_mask``)."""
        trajectory = build_trajectory(request, segments, self.config)
        # See NOTE [ Next-token alignment ] (knitkit/next_token.py): stored once, shifted once.
        trajectory.token_fields = next_token_fields(trajectory.token_fields)
        return self.store.write(trajectory)

    def add_batch(
        self, requests: Sequence[RolloutRequest], outputs: Sequence[Mapping[str, Any]]
    ) -> list[TrajectoryMeta | None]:
        """Add the list a batch (or ``n > 1``) request returns, one request per output, in order.

        SGLang returns a batch of prompts with ``n`` samples prompt by prompt: p0's ``n``
        outputs, then p1's, and so on.
        """
        if len(requests) != len(outputs):
            raise ValueError(
                f"{len(requests)} requests for {len(outputs)} outputs; pair them one to one"
            )
        return [self.add(r, o) for r, o in zip(requests, outputs, strict=True)]

    def continuation_ids(self, request: RolloutRequest) -> list[int]:
        """``input_ids`` of the next request of a held trajectory: its prompt plus everything since."""
        segments = self._held.get(request.trajectory_id)
        if segments is None:
            raise KeyError(
                f"trajectory {request.trajectory_id!r} has nothing held to continue (no aborted "
                "output or unfinished episode)"
            )
        tail = (
            s.token_ids if isinstance(s, EnvironmentTokens) else s.output_ids.tolist()
            for s in segments
        )
        return [*request.input_ids, *(t for piece in tail for t in piece)]

    def drop(self, trajectory_id: str) -> None:
        """Forget a held trajectory that will not be continued (nothing of it was stored)."""
        self._held.pop(trajectory_id, None)

    @property
    def partial(self) -> tuple[str, ...]:
        """Trajectories held for a continuation or their next turn."""
        return tuple(self._held)

    def _hold(
        self,
        request: RolloutRequest,
        output: GenerateOutput | Mapping[str, Any],
        routed_experts_start: int,
    ) -> GenerateOutput:
        if not isinstance(output, GenerateOutput):
            output = parse_generate_output(
                output,
                routing_shape=self.config.routing_shape,
                routed_experts_start=routed_experts_start,
            )
        if output.finish is None:
            raise ValueError(
                f"trajectory {request.trajectory_id!r}: output {output.rid!r} is still running; "
                "fold a stream with StreamAccumulator and add its result()"
            )
        held = self._held.get(request.trajectory_id, [])
        check_prompt_tokens(
            request.trajectory_id, output, len(request.input_ids) + sum(map(_length, held))
        )
        self._held[request.trajectory_id] = [*held, output]
        return output


def _length(segment: Segment) -> int:
    if isinstance(segment, EnvironmentTokens):
        return len(segment.token_ids)
    return len(segment.output_ids)
