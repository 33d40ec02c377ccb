"""Transformer Engine, optional (``pip install knitkit[te]``): layer specs and the matching batch form.

With TE, attention runs packed THD sequences (``PackedSeqParams`` from ``cu_seqlens``) and
context parallelism; without it, megatron's local attention takes a block-causal mask (CP=1).
Everything here imports TE lazily, so the module loads (and type-checks) on machines without it.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from knitkit.integration.megatron.batch import Batch, megatron_batch
from knitkit.microbatch_iter import MicroBatch

FP8_PAD_MULTIPLE = 16
"""FP8 GEMMs under TE need every packed length a multiple of 16: ``PlannerConfig(pad_multiple=16)``."""


def te_available() -> bool:
    """True when ``transformer_engine`` is importable (checked without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


@dataclass(frozen=True, slots=True)
class LayerSpecs:
    """megatron-core layer specs for a VLM's language model and vision transformer."""

    language: object
    vision: object
    use_te: bool


def layer_specs(use_te: bool | None = None, qk_layernorm: bool = False) -> LayerSpecs:
    """TE layer specs when TE is installed (or ``use_te=True``), megatron's local specs otherwise."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.vision.vit_layer_specs import (
        get_vit_layer_with_local_spec,
        get_vit_layer_with_transformer_engine_spec,
    )

    use_te = te_available() if use_te is None else use_te
    if use_te and not te_available():
        raise ImportError(
            "use_te=True but transformer_engine is not installed; pip install 'knitkit[te]'"
        )
    if use_te:
        return LayerSpecs(
            get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm),
            get_vit_layer_with_transformer_engine_spec(),
            True,
        )
    return LayerSpecs(
        get_gpt_layer_local_spec(qk_layernorm=qk_layernorm), get_vit_layer_with_local_spec(), False
    )


def batch_for(use_te: bool, cp_size: int = 1) -> Callable[[MicroBatch], Batch]:
    """``to_batch`` for ``megatron_batches``: THD with ``PackedSeqParams`` under TE, a mask otherwise.

    Local attention refuses ``PackedSeqParams``, so its batches carry the block-causal mask
    instead (and no ``packed_seq_params``); it cannot run CP > 1.
    """
    if use_te:
        return functools.partial(megatron_batch, cp_size=cp_size)
    if cp_size > 1:
        raise ValueError(
            f"cp_size={cp_size} needs Transformer Engine attention (THD with CP); "
            "pip install 'knitkit[te]' and build the model with layer_specs(use_te=True)"
        )
    return _masked_batch


def _masked_batch(micro_batch: MicroBatch) -> Batch:
    batch = megatron_batch(micro_batch, attention_mask=True)
    del batch["packed_seq_params"]
    return batch
