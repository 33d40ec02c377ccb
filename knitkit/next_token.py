"""The one next-token convention of stored training fields: position t predicts token t+1.

NOTE [ Next-token alignment ]: a causal LM's output at position t scores token t+1. Stored
per-token fields that describe that prediction sit at the predicting position:
``labels[t] = tokens[t+1]``; ``loss_mask[t] = 1`` iff token t+1 is trained (generated);
``logprobs[t]`` is the rollout's log-prob of token t+1. A sequence's last position predicts
nothing (label, mask and log-prob 0). Input-side fields (``tokens``, ``position_ids``, MoE
``routing``) stay at their own token. The shift is made once, on the whole trajectory before it
is stored (``next_token_fields``, called by the SGLang ``RolloutWriter``), so any later cut --
micro-batch pieces, CP zigzag chunks -- keeps each prediction with its label: a roll per packed
chunk would pair a chunk's last token with the next chunk's first, which is wrong under CP.
``megatron_batch`` passes these fields through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

TOKENS = "tokens"
LABELS = "labels"
PREDICTION_FIELDS = ("loss_mask", "logprobs")
"""Token-aligned fields that describe a token's prediction, shifted to the predicting position."""


def next_token_fields(
    fields: Mapping[str, np.ndarray], prediction_fields: tuple[str, ...] = PREDICTION_FIELDS
) -> dict[str, np.ndarray]:
    """Token-aligned fields (value t belongs to token t) in the next-token convention (see NOTE [ Next-token alignment ]).

    Adds ``labels`` (the tokens shifted left by one) and shifts every field of
    ``prediction_fields`` present the same way; the other fields are returned as they are.
    """
    if LABELS in fields:
        raise ValueError(
            f"fields already hold {LABELS!r}: they are in the next-token convention; shift once"
        )
    out = dict(fields)
    for name in (TOKENS, *(f for f in prediction_fields if f in fields)):
        source = fields[name]
        shifted = np.zeros_like(source)
        shifted[:-1] = source[1:]
        out[LABELS if name == TOKENS else name] = shifted
    return out
