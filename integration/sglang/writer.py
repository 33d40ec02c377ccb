"""Streaming rollout into a ``TrajectoryStore``: each finished SGLang output becomes a stored trajectory."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from knitkit.next_token import next_token_fields
from knitkit.storage import TrajectoryStore
from knitkit.types import TrajectoryMeta

from .response import GenerateOutput, parse_generate_output
from .trajectory import PayloadConfig, RolloutRequest, build_trajectory


class RolloutWriter:
    """Writes each finished trajectory to the store as it completes and returns its admission metadata.

    Stored fields follow the next-token convention (``knitkit.next_token``): ``tokens`` and
    ``routing`` at their token; ``labels``, ``loss_mask`` and ``logprobs`` at the position that
    predicts the token (position t predicts token t+1), ready for a CP split.

    An aborted output (a partial rollout, e.g. paused for a weight update) is kept until the
    request is continued with ``continuation_ids(request)`` and finishes; the trajectory then
    spans every segment and its ``min_version``/``max_version`` cover all of them.

    Not thread-safe: feed it from the one loop that collects the rollout's outputs.
    """

    def __init__(self, store: TrajectoryStore, config: PayloadConfig | None = None) -> None:
        self.store = store
        self.config = config or PayloadConfig()
        self._partial: dict[str, list[GenerateOutput]] = {}

    def add(
        self,
        request: RolloutRequest,
        output: GenerateOutput | Mapping[str, Any],
        *,
        routed_experts_start: int = 0,
    ) -> TrajectoryMeta | None:
        """Add one output of ``request`` (parsed, or the raw ``/generate`` dict).

        Returns the stored trajectory's metadata (report it to admission), or None when the output
        was aborted and the trajectory waits for its continuation.
        """
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
        segments = [*self._partial.get(request.trajectory_id, []), output]
        if output.finish.aborted:
            self._partial[request.trajectory_id] = segments
            return None
        trajectory = build_trajectory(request, segments, self.config)
        # See NOTE [ Next-token alignment ] (knitkit/next_token.py): stored once, shifted once.
        trajectory.token_fields = next_token_fields(trajectory.token_fields)
        meta = self.store.write(trajectory)
        self._partial.pop(request.trajectory_id, None)
        return meta

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
        """``input_ids`` that resume an aborted trajectory: its prompt plus everything generated so far."""
        segments = self._partial.get(request.trajectory_id)
        if segments is None:
            raise KeyError(
                f"trajectory {request.trajectory_id!r} has no aborted output to continue"
            )
        return [*request.input_ids, *(t for s in segments for t in s.output_ids.tolist())]

    def drop(self, trajectory_id: str) -> None:
        """Forget an aborted trajectory that will not be continued (nothing of it was stored)."""
        self._partial.pop(trajectory_id, None)

    @property
    def partial(self) -> tuple[str, ...]:
        """Trajectories waiting for a continuation."""
        return tuple(self._partial)
