"""Where this rank computes, and where tensors for a process group's collectives must live."""

from __future__ import annotations

import torch
import torch.distributed as dist


def current_device() -> torch.device:
    """This rank's compute device: the current CUDA device if CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of tensors that travel in ``group``'s collectives: NCCL moves CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return current_device()
    return torch.device("cpu")
