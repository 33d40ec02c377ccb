"""The prefetch iterator alone, around an existing DataLoader: fetching overlaps the training step.

The dataset is slow (20 ms of I/O per batch) and so is the step (30 ms of compute, simulated);
iterating the DataLoader directly exposes every fetch, the MicroBatchIterator hides them.

Run: python examples/prefetch_around_dataloader.py
"""

import time

import torch
from torch.utils.data import DataLoader, Dataset

from knitkit.microbatch_iter import MicroBatchIterator


class SlowDataset(Dataset):
    """Packed micro-batches that take 20 ms each to read (a remote store, a disk, a decoder)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(0.020)
        return {"tokens": torch.full((4096,), i, dtype=torch.int32), "loss_mask": torch.ones(4096)}


def train_step(batch) -> None:
    time.sleep(0.030)  # forward + backward


loader = DataLoader(SlowDataset(), batch_size=None, num_workers=0)  # your existing loader

start, waited = time.perf_counter(), 0.0
for batch in loader:  # eager: every fetch sits on the critical path
    waited += time.perf_counter() - start
    train_step(batch)
    start = time.perf_counter()
print(f"eager    : {waited:.3f} s waiting for data")

with MicroBatchIterator(loader, MicroBatchIterator.Config(depth=2)) as batches:
    for mb in batches:  # same items, staged ahead while the step runs
        assert mb["tokens"][0] == mb.index
        train_step(mb)
    stats = batches.stats
print(
    f"prefetch : {stats.wait_s:.3f} s waiting for data ({stats.first_wait_s:.3f} s of it for the first)"
)
