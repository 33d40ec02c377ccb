"""Fold a streamed ``/generate`` request (server-sent events) into one ``GenerateOutput``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .response import GenerateOutput, parse_generate_output


def iter_sse_events(lines: Iterable[bytes | str]) -> Iterator[dict[str, Any]]:
    """Yield the JSON chunks of a ``/generate`` stream body (``data: {...}`` lines, ``data: [DONE]``).

    Raises ``ValueError`` on the ``{"error": ...}`` chunk SGLang sends when a request fails mid-stream.
    """
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue  # blank separators and SSE comments
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise ValueError(f"SGLang stream failed: {chunk['error']}")
        yield chunk


class StreamAccumulator:
    """Collects one streamed request's chunks, incremental or cumulative, and the version of each token.

    SGLang streams either deltas (``--incremental-streaming-output``) or the whole output so far
    (the default); ``meta_info["completion_tokens"]`` is cumulative in both, which tells them apart.
    Each chunk's new tokens are attributed to that chunk's ``weight_version``, so a request that
    straddles a weight update reports both the oldest and newest version that generated it.
    """

    def __init__(
        self, *, routing_shape: tuple[int, int] | None = None, routed_experts_start: int = 0
    ) -> None:
        self._routing_shape = routing_shape
        self._routed_experts_start = routed_experts_start
        self._ids: list[int] = []
        self._logprobs: list[list[Any]] = []
        self._meta: Mapping[str, Any] = {}
        self._first_version: str | None = None
        self.versions: list[tuple[int, str]] = []
        """``(first token index, weight_version)`` at every version change, in token order."""

    @property
    def finished(self) -> bool:
        return self._meta.get("finish_reason") is not None

    def feed(self, chunk: Mapping[str, Any]) -> int:
        """Add one chunk; returns how many new tokens it carried."""
        if self.finished:
            raise ValueError(
                f"request {self._meta.get('id')!r} already finished; got another chunk"
            )
        meta = chunk["meta_info"]
        ids = list(chunk["output_ids"])
        total = int(meta["completion_tokens"])
        seen = len(self._ids)
        if len(ids) == total and total >= seen:
            start = seen  # cumulative chunk: the whole output so far
        elif seen + len(ids) == total:
            start = 0  # incremental chunk: only the new tokens
        else:
            raise ValueError(
                f"request {meta.get('id')!r}: chunk with {len(ids)} output_ids does not extend "
                f"{seen} seen tokens to completion_tokens={total}"
            )
        new_ids = ids[start:]
        entries = meta.get("output_token_logprobs")
        if entries is not None:
            self._logprobs.extend(entries[start:] if len(entries) == total else entries)
        version = str(meta.get("weight_version", "default"))
        if new_ids and (not self.versions or self.versions[-1][1] != version):
            self.versions.append((seen, version))
        if new_ids and self._first_version is None:
            self._first_version = version
        self._ids.extend(new_ids)
        self._meta = meta
        return len(new_ids)

    def result(self) -> GenerateOutput:
        """The finished request as one output; ``first_version`` is that of its first token."""
        if not self.finished:
            raise ValueError(
                f"request {self._meta.get('id')!r} has no finish_reason yet; feed every chunk first"
            )
        meta = dict(self._meta)
        if self._logprobs:
            meta["output_token_logprobs"] = self._logprobs
        output = parse_generate_output(
            {"output_ids": self._ids, "meta_info": meta},
            routing_shape=self._routing_shape,
            routed_experts_start=self._routed_experts_start,
        )
        first = self._first_version or output.weight_version
        return dataclasses.replace(output, first_version=first)


def fold_stream(
    chunks: Iterable[Mapping[str, Any]],
    *,
    routing_shape: tuple[int, int] | None = None,
    routed_experts_start: int = 0,
) -> list[GenerateOutput]:
    """Fold a whole stream, single or batched, into one output per request, in batch order.

    A batched stream (a list of prompts, or ``n > 1``) interleaves its requests' chunks and tags
    each with its position ``index``; a single request's chunks have none.
    """
    accumulators: dict[int, StreamAccumulator] = {}
    for chunk in chunks:
        index = int(chunk.get("index", 0))
        if index not in accumulators:
            accumulators[index] = StreamAccumulator(
                routing_shape=routing_shape, routed_experts_start=routed_experts_start
            )
        accumulators[index].feed(chunk)
    if sorted(accumulators) != list(range(len(accumulators))):
        raise ValueError(
            f"stream has chunks for batch positions {sorted(accumulators)}; some are missing"
        )
    return [accumulators[i].result() for i in range(len(accumulators))]
