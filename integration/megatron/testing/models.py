"""The twin models of a check: built alike from the user's provider, and the gradients read off them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from knitkit.integration.megatron.testing.contract import checked_model
from knitkit.integration.megatron.testing.subject import VLMUnderTest, resolve


def build(subject: VLMUnderTest, seed: int) -> list[Any]:
    """This rank's model chunks from the provider, torch's and megatron's RNG seeded first."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    return checked_model(subject.provider, resolve(subject.provider)())


def same_weights(reference: list[Any], wrapped: list[Any]) -> None:
    """Refuse a provider whose two builds differ: the check would compare different models."""
    for ref_chunk, chunk in zip(reference, wrapped, strict=True):
        for (name, ref), mine in zip(
            unwrap(ref_chunk).named_parameters(), unwrap(chunk).parameters(), strict=True
        ):
            if not torch.equal(ref, mine):
                raise ValueError(
                    f"the provider built different weights on two calls (first at {name!r}); "
                    "draw every initial weight from torch's or megatron's seeded RNG"
                )


def unit_encoder(
    subject: VLMUnderTest, chunk: torch.nn.Module
) -> Callable[[torch.Tensor], torch.Tensor]:
    if subject.encoder is not None:
        return resolve(subject.encoder)(chunk)
    vision = module_at(unwrap(chunk), subject.vision)
    encode = getattr(vision, "encode", None)
    return encode if callable(encode) else vision


def module_at(model: torch.nn.Module, dotted: str) -> torch.nn.Module:
    module = model
    for part in dotted.split("."):
        if not hasattr(module, part):
            raise AttributeError(
                f"the unwrapped model has no attribute {dotted!r}; pass VLMUnderTest(vision=...) "
                "the dotted path of the module that turns images into features"
            )
        module = getattr(module, part)
    return module


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
    return grad


def owned_grad(ddp: Any, param: torch.nn.Parameter) -> torch.Tensor:
    """The part of ``param``'s gradient whose reduction this rank owns.

    All of it with a plain DDP all-reduce; with ``use_distributed_optimizer`` the elements in
    this DP rank's shard of the parameter's bucket (megatron's ``shard_buffer``), the only ones
    the reduce-scatter makes valid and the only ones this rank's optimizer steps.
    """
    from megatron.core import parallel_state

    flat = grad_of(param).view(-1)
    config = getattr(ddp, "ddp_config", None)
    if config is None or not config.use_distributed_optimizer:
        return flat
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    for buffer in ddp.buffers:
        if param in buffer.param_index_map:
            start, end, bucket_id = buffer.param_index_map[param]
            bucket = buffer.buckets[bucket_id]
            shard = bucket.grad_data.numel() // size
            lo = max(start, bucket.offset + rank * shard)
            hi = min(end, bucket.offset + (rank + 1) * shard)
            return flat[max(lo - start, 0) : max(hi - start, 0)]
    raise ValueError("a trainable parameter is in none of megatron DDP's buffers")
