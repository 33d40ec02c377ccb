"""Parse one SGLang ``/generate`` output (``{"text", "output_ids", "meta_info"}``) into arrays."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

ROUTED_EXPERTS_WIRE = {"int32": "<i4", "uint16": "<u2", "uint8": "u1"}
"""``meta_info["routed_experts_dtype"]`` -> numpy dtype of the base64 payload (little-endian, C order);
absent means int32 (SGLang before its narrow wire encodings, PR 31219)."""

FINISH_KINDS = ("stop", "length", "abort")
"""``meta_info["finish_reason"]["type"]`` values (``FINISH_*.to_json`` in SGLang's ``schedule_batch.py``)."""


@dataclass(frozen=True, slots=True)
class FinishReason:
    """Why SGLang stopped a request: ``stop`` (EOS or stop string), ``length`` or ``abort``."""

    kind: str
    matched: int | str | list[int] | None = None
    """The EOS token id or stop string that ended a ``stop``."""
    length: int | None = None
    """``max_new_tokens`` for ``length``."""
    message: str | None = None
    """Why an ``abort`` happened (a paused weight update, a bad request, a client disconnect)."""

    @property
    def aborted(self) -> bool:
        """True when the output is a partial rollout that must be continued or dropped."""
        return self.kind == "abort"

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> FinishReason:
        kind = value.get("type")
        if kind not in FINISH_KINDS:
            raise ValueError(
                f"finish_reason type {kind!r} is not one of {FINISH_KINDS}: {dict(value)}"
            )
        return cls(str(kind), value.get("matched"), value.get("length"), value.get("message"))


@dataclass(frozen=True, slots=True)
class GenerateOutput:
    """One request's generated tokens and what SGLang reported about them."""

    rid: str
    output_ids: np.ndarray
    """int32 ``[completion]``: the generated token ids."""
    logprobs: np.ndarray | None
    """float32 ``[completion]`` sampling log-probs, or None without ``return_logprob``."""
    routed_experts: np.ndarray | None
    """int32 ``[rows, layers, topk]`` (``[rows, layers * topk]`` without a routing shape) for
    positions ``[routed_experts_start, prompt_tokens + completion - 1)``, or None."""
    routed_experts_start: int
    finish: FinishReason | None
    """None while a streamed request is still running."""
    prompt_tokens: int
    first_version: str
    """``weight_version`` when the first of these tokens was reported (streaming), else the final one."""
    weight_version: str
    """``weight_version`` of the server when the output was reported."""
    e2e_latency: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the length of the trajectory's sequence."""
        return self.prompt_tokens + len(self.output_ids)


def parse_generate_output(
    out: Mapping[str, Any],
    *,
    routing_shape: tuple[int, int] | None = None,
    routed_experts_start: int = 0,
) -> GenerateOutput:
    """Parse one output of ``/generate`` (or one element of the list a batch request returns).

    ``routing_shape`` is the MoE model's ``(num_hidden_layers, num_experts_per_tok)``; the response
    does not carry it. ``routed_experts_start`` is the request's ``routed_experts_start_len``.
    """
    if "error" in out:
        raise ValueError(f"SGLang returned an error instead of an output: {out['error']}")
    meta = out.get("meta_info")
    if not isinstance(meta, Mapping) or "output_ids" not in out:
        raise ValueError(
            f"not a /generate output: keys {sorted(out)}; expected 'output_ids' and 'meta_info' "
            "(send input_ids, or skip_tokenizer_init, so output_ids are returned)"
        )
    rid = str(meta.get("id", ""))
    output_ids = np.asarray(out["output_ids"], dtype=np.int32).reshape(-1)
    completion = meta.get("completion_tokens")
    if completion is not None and int(completion) != len(output_ids):
        raise ValueError(
            f"request {rid!r}: meta_info.completion_tokens={completion} but {len(output_ids)} "
            "output_ids; a truncated or mixed-up response (for a stream, fold every chunk with "
            "StreamAccumulator)"
        )
    logprobs = _output_logprobs(meta, output_ids, rid)
    prompt_tokens = int(meta["prompt_tokens"])
    routed = meta.get("routed_experts")
    routed_experts = None
    if routed is not None:
        rows = prompt_tokens + len(output_ids) - 1 - routed_experts_start
        routed_experts = decode_routed_experts(
            routed,
            rows,
            routing_shape,
            dtype=str(meta.get("routed_experts_dtype", "int32")),
            rid=rid,
        )
    finish_json = meta.get("finish_reason")
    version = str(meta.get("weight_version", "default"))
    latency = meta.get("e2e_latency")
    return GenerateOutput(
        rid=rid,
        output_ids=output_ids,
        logprobs=logprobs,
        routed_experts=routed_experts,
        routed_experts_start=routed_experts_start,
        finish=None if finish_json is None else FinishReason.from_json(finish_json),
        prompt_tokens=prompt_tokens,
        first_version=version,
        weight_version=version,
        e2e_latency=None if latency is None else float(latency),
    )


def decode_routed_experts(
    value: object,
    rows: int,
    routing_shape: tuple[int, int] | None = None,
    *,
    dtype: str = "int32",
    rid: str = "",
) -> np.ndarray:
    """Decode ``meta_info["routed_experts"]`` into int32 ``[rows, layers, topk]``.

    Over the wire it is base64 of a C-order ``[rows, layers, topk]`` array of ``dtype`` (the
    server's ``routed_experts_dtype``: int32, uint16 or uint8); with ``skip_tokenizer_init`` the
    tokenizer manager passes the array through unencoded (an array in-process, lists in JSON).
    """
    if isinstance(value, str):
        if dtype not in ROUTED_EXPERTS_WIRE:
            raise ValueError(
                f"request {rid!r}: routed_experts_dtype {dtype!r} is not one of "
                f"{sorted(ROUTED_EXPERTS_WIRE)}; decode it yourself with decode_routed_experts"
            )
        wire = ROUTED_EXPERTS_WIRE[dtype]
        flat = np.frombuffer(base64.b64decode(value), dtype=wire).astype(np.int32)
    else:
        flat = np.asarray(value).reshape(-1).astype(np.int32)
    if rows <= 0 or flat.size % rows:
        raise ValueError(
            f"request {rid!r}: routed_experts holds {flat.size} ids, not a multiple of {rows} rows "
            "(prompt_tokens + completion - 1 - routed_experts_start_len)"
        )
    if routing_shape is None:
        return flat.reshape(rows, -1)
    layers, topk = routing_shape
    if flat.size != rows * layers * topk:
        raise ValueError(
            f"request {rid!r}: routed_experts holds {flat.size} ids; {rows} rows x {layers} layers "
            f"x {topk} topk = {rows * layers * topk}; check routing_shape against the model config"
        )
    return flat.reshape(rows, layers, topk)


def parse_weight_version(text: str, *, initial: int = 0) -> int:
    """Map SGLang's ``weight_version`` string to an integer policy version.

    A fresh server reports ``"default"`` (``ServerArgs.weight_version``), read as ``initial``;
    otherwise the trainer must push integer versions (``update_weights_*(weight_version=str(step))``).
    """
    if text == "default":
        return initial
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"weight_version {text!r} is not an integer; push weights with "
            "weight_version=str(policy_version), or pass version_of= to map your own labels"
        ) from None


def _output_logprobs(
    meta: Mapping[str, Any], output_ids: np.ndarray, rid: str
) -> np.ndarray | None:
    """``output_token_logprobs`` entries are ``[logprob, token_id, text_or_null]``."""
    entries = meta.get("output_token_logprobs")
    if entries is None:
        return None
    if len(entries) != len(output_ids):
        raise ValueError(
            f"request {rid!r}: {len(entries)} output_token_logprobs for {len(output_ids)} output_ids"
        )
    ids = np.fromiter((entry[1] for entry in entries), dtype=np.int64, count=len(entries))
    if not np.array_equal(ids, output_ids):
        raise ValueError(f"request {rid!r}: output_token_logprobs token ids differ from output_ids")
    return np.fromiter((entry[0] for entry in entries), dtype=np.float32, count=len(entries))
