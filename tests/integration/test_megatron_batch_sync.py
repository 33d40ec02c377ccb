"""megatron_batch builds a step's tensors without a host sync (issue 31.3): same tensors as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from knitkit.integration.megatron import megatron_batch
from knitkit.microbatch_iter import MicroBatch, MicroBatchIterator, PackedMicroBatch
from knitkit.types import MicroBatchLayout

# three sequences, the middle one empty (real length 0, padded 2): its "last" position must not
# mask anything
REAL, PADDED = (5, 0, 3), (6, 2, 4)


def _micro_batch(with_layout_cu: bool = True) -> MicroBatch:
    total = sum(PADDED)
    cu = np.cumsum((0, *REAL)).astype(np.int32)
    cu_padded = np.cumsum((0, *PADDED)).astype(np.int32)
    fields = {
        "tokens": ("int64", (total,)),
        "loss_mask": ("float32", (total,)),
        "position_ids": ("int64", (total,)),
        "cu_seqlens": ("int32", (4,)),
        "cu_seqlens_padded": ("int32", (4,)),
    }
    padded_host = tuple(int(x) for x in cu_padded) if with_layout_cu else ()
    layout = MicroBatchLayout.build(fields, cu_seqlens_padded=padded_host)
    buffer = np.zeros(layout.nbytes, np.uint8)
    views = layout.numpy_views(buffer)
    views["tokens"][:] = np.arange(100, 100 + total)
    views["loss_mask"][:] = 1.0
    views["position_ids"][:] = np.arange(total)
    views["cu_seqlens"][:] = cu
    views["cu_seqlens_padded"][:] = cu_padded
    with MicroBatchIterator([PackedMicroBatch(layout, buffer)]) as iterator:
        mb = next(iter(iterator))
        return MicroBatch(
            mb.index,
            mb.layout,
            mb.flat.clone(),
            {k: v.clone() for k, v in mb.tensors.items()},
            mb.stats,
        )


def _old_labels_and_mask(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """What megatron_batch computed before issue 31 (a boolean index: a sync on a GPU)."""
    tokens, cu, cu_padded = mb["tokens"].long(), mb["cu_seqlens"], mb["cu_seqlens_padded"]
    real = cu[1:] - cu[:-1]
    last = (cu_padded[:-1] + real - 1)[real > 0].long()
    labels = torch.roll(tokens, -1)
    labels[last] = 0
    mask = mb["loss_mask"].float().clone()
    mask[last] = 0.0
    return labels, mask


def test_labels_mask_and_max_seqlen_equal_the_synchronising_version() -> None:
    """Labels and loss mask equal the old boolean-index result (an empty sequence masks
    nothing), and ``max_seqlen`` comes from the layout's host copy of ``cu_seqlens_padded``
    with the value the tensors give (and from the tensors when the layout has none)."""
    for with_layout_cu in (True, False):
        mb = _micro_batch(with_layout_cu)
        batch = megatron_batch(mb, attention_mask=True)
        labels, mask = _old_labels_and_mask(mb)
        assert torch.equal(batch["labels"][0], labels)
        assert torch.equal(batch["loss_mask"][0], mask)
        params = batch["packed_seq_params"]
        assert params.max_seqlen_q == params.max_seqlen_kv == max(PADDED)
        assert batch["attention_mask"].shape == (1, 1, sum(PADDED), sum(PADDED))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counting host syncs needs CUDA")
def test_megatron_batch_does_not_sync_on_cuda() -> None:
    """torch's sync debug mode set to error: building the batch from device tensors runs."""
    mb = _micro_batch()
    on_gpu = MicroBatch(
        mb.index,
        mb.layout,
        mb.flat.cuda(),
        {k: v.cuda() for k, v in mb.tensors.items()},
        mb.stats,
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = megatron_batch(on_gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert batch["packed_seq_params"].max_seqlen_q == max(PADDED)
