"""Transformer Engine as an optional extra: the adapter's TE paths load without TE, and FP8 padding.

TE itself runs only on GPUs (tests marked ``cuda`` in test_megatron_{llava,mrope}.py, listed by
``benchmarks/gpu_check.sh``); here: what must hold on every machine.
"""

from __future__ import annotations

import numpy as np
import pytest

from knitkit.integration.megatron import FP8_PAD_MULTIPLE, batch_for, layer_specs, te_available
from knitkit.storage import (
    MemoryBackend,
    PlannerConfig,
    Topology,
    Trajectory,
    TrajectoryStore,
    pack,
    plan_minibatch,
)


@pytest.mark.skipif(te_available(), reason="checks the machine without Transformer Engine")
def test_without_te_local_specs_and_clear_errors() -> None:
    """Without TE: local specs by default; asking for TE or CP>1 attention names the extra to install."""
    assert not layer_specs().use_te
    with pytest.raises(ImportError, match=r"knitkit\[te\]"):
        layer_specs(use_te=True)
    with pytest.raises(ValueError, match=r"cp_size=2 needs Transformer Engine"):
        batch_for(use_te=False, cp_size=2)


@pytest.mark.parametrize("cp", [1, 2])
def test_fp8_padding_makes_every_cp_chunk_a_multiple_of_16(cp: int) -> None:
    """PlannerConfig(pad_multiple=16): every sequence's CP chunks, and so each packed length, are multiples of 16."""
    store = TrajectoryStore(MemoryBackend())
    rng = np.random.default_rng(0)
    ids = []
    for i in range(12):
        tokens = rng.integers(1, 50, size=int(rng.integers(5, 90))).astype(np.int64)
        store.write(Trajectory(f"t{i}", f"s{i}", {"tokens": tokens}))
        ids.append(f"t{i}")
    config = PlannerConfig(
        token_fields=("tokens",),
        scalar_fields=(),
        min_micro_batches=2,
        pad_multiple=FP8_PAD_MULTIPLE,
    )
    plan = plan_minibatch(store.metas(ids), Topology(dp=2, cp=cp), config)
    seen = 0
    for dp in range(2):
        for rank in range(cp):
            for mb in plan.consumer(dp, rank).micro_batches:
                for seq in mb.sequences:
                    assert seq.padded_length % (FP8_PAD_MULTIPLE * (2 * cp if cp > 1 else 1)) == 0
                    assert all((b - a) % FP8_PAD_MULTIPLE == 0 for a, b in seq.chunks)
                    assert seq.padded_length - seq.num_tokens < FP8_PAD_MULTIPLE * 2 * cp
                    seen += 1
                layout, buffer = pack(mb, store.schema("t0"), store.read_into)
                assert len(layout.numpy_views(buffer)["tokens"]) % FP8_PAD_MULTIPLE == 0
    assert seen == 12 * cp


def test_pad_multiple_must_be_a_positive_int() -> None:
    """A padding knob of 0 is refused with the field's name."""
    with pytest.raises(ValueError, match="pad_multiple=0"):
        PlannerConfig(pad_multiple=0)
