"""Share the driver's ``RankSpec`` with every rank over torch.distributed, as UTF-8 bytes (no pickle)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from knitkit.job.spec import RankSpec


def broadcast_rank_spec(
    spec: RankSpec | None, *, src: int = 0, group: dist.ProcessGroup | None = None
) -> RankSpec:
    """Every rank of ``group`` gets the spec rank ``src`` holds (a collective: call it on all).

    The spec travels as its JSON in a uint8 tensor after its length, over the group's backend
    (on the current CUDA device for NCCL), so no rank unpickles what another wrote.
    """
    me = dist.get_rank()
    if me == src and spec is None:
        raise ValueError(f"broadcast_rank_spec: rank {src} (src) must pass the driver's RankSpec")
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )
    data = spec.to_json().encode() if me == src and spec is not None else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if me == src:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(payload, src, group=group)
    return RankSpec.from_json(bytes(payload.cpu().numpy().tobytes()).decode())
