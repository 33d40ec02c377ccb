"""Each position's segment for segments laid end to end, built off torch's intra-op thread pool."""

from __future__ import annotations

import numpy as np
import torch

# NOTE [ Segment ids off the intra-op pool ]:
# "Which sequence (run, row block) does each position belong to" is asked per micro-batch on the
# prefetch thread (block-causal masks, per-token weights, scalar fields spread over tokens) and per
# mini-batch by every rank's dedup route. Two torch idioms answer it through torch's intra-op
# thread pool even on a few thousand elements: ``torch.repeat_interleave`` (its CPU kernel runs
# ``at::parallel_for`` with a grain of one element) and a gather by advanced indexing,
# ``x[ids]``. Each pool entry wakes pool threads that spin for CPU the prefetch and training
# threads need. Measured on 2 loaded cores (load ~10-20), 12 segments over 4,000 positions:
# ``repeat_interleave`` 11 us of CPU with one intra-op thread, 1,300 us with two; ``x[ids]``
# 8,000 us with two; ``np.repeat`` 6 us and ``x.index_select(0, ids)`` 3 us either way. So every
# such site builds its ids with ``segment_ids`` (``np.repeat`` on the host, one kernel on an
# accelerator, no sync when the caller passes ``total``) and gathers with ``index_select``; the
# dedup route's row indices, host-only, are built in numpy end to end (``_index`` in plan.py).
# tests/encoder_dedup/test_segments.py and tests/integration/test_megatron_batch.py check that the
# hot paths call neither idiom.


def segment_ids(lengths: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``torch.repeat_interleave(torch.arange(len(lengths)), lengths)`` (int64, on ``lengths``'s
    device), without torch's intra-op pool on the host (NOTE [ Segment ids off the intra-op pool ]).

    ``total`` (the sum of ``lengths``) spares a device-to-host sync on an accelerator; on the
    host it is checked.
    """
    if lengths.device.type != "cpu":
        return torch.repeat_interleave(
            torch.arange(len(lengths), device=lengths.device), lengths.long(), output_size=total
        )
    counts = lengths.numpy()
    ids = torch.from_numpy(np.repeat(np.arange(len(counts), dtype=np.int64), counts))
    if total is not None and ids.numel() != total:
        raise ValueError(f"segment lengths sum to {ids.numel()}, not total={total}")
    return ids
