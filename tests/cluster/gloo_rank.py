"""Run on a simulated node: rank ``RANK`` of a two-rank gloo group whose store is on host
``node0``; prints its hostname and the all-reduced sum of every rank's ``rank + 1``."""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist


def main(rank: int, world_size: int) -> None:
    dist.init_process_group(
        "gloo", init_method="tcp://node0:29500", rank=rank, world_size=world_size
    )
    try:
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value)
        print(socket.gethostname(), int(value.item()), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
