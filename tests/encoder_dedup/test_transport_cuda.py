"""A bounded wait for a GPU row exchange wakes when the rows land, not at a poll's next tick.

The old wait polled ``is_completed`` with a back-off doubling to 50 ms, so a rank learned of an
exchange that finished after ~100 ms of GPU work only ~50 ms later (NOTE [ Host waits for GPU
exchanges ]). NCCL world of one on one GPU; skipped where there is none.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from knitkit.encoder_dedup.transport import gather_rows

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(),
    reason="needs a CUDA GPU with NCCL: torch.cuda.is_available() is False on this machine",
)

GPU_WORK_S = 0.11
"""Between the old poll's ticks at ~102 ms and ~154 ms after the wait began."""


def _sleep_on_gpu(cycles: int) -> float:
    """Seconds the host waits, blocking, for ``cycles`` of GPU sleep on the current stream."""
    torch.cuda.synchronize()
    started = time.monotonic()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return time.monotonic() - started


def test_bounded_gpu_exchange_wakes_when_the_rows_land() -> None:
    """``gather_rows`` behind ~110 ms of GPU work returns within 20 ms of a plain blocking
    synchronize of the same work (the old back-off returned ~45 ms late), with the rows."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        row = torch.arange(4.0, device="cuda")[None]
        gather_rows(row, timeout_s=30.0)  # communicator set-up, outside the measurement
        cycles = int(1e7)
        cycles = int(cycles * GPU_WORK_S / _sleep_on_gpu(cycles))
        plain = min(_sleep_on_gpu(cycles) for _ in range(3))
        late = []
        for _ in range(3):
            torch.cuda.synchronize()
            started = time.monotonic()
            torch.cuda._sleep(cycles)
            out = gather_rows(row, timeout_s=30.0)
            late.append(time.monotonic() - started - plain)
            torch.testing.assert_close(out, row)
        assert min(late) < 0.02, f"the wait woke {min(late) * 1e3:.1f} ms after the rows landed"
    finally:
        dist.destroy_process_group()
