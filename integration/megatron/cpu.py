"""Run megatron-core's ``parallel_state`` and tensor-parallel layers on CPU with gloo (for tests and checks).

megatron-core 0.16.1 assumes CUDA in a few places (``torch.cuda.current_device()`` as an allocation
device, the CUDA RNG tracker, ``device="cuda"`` in the schedules, the ViT's position ids, p2p
synchronisation). The functions here patch exactly those, process-locally (one module's ``torch``
reference at a time; ``torch.cuda.current_device`` in this process), and patch NOTHING when CUDA is
present: megatron-core then runs as in production. This lets real ``parallel_state`` groups,
``ColumnParallelLinear`` / ``RowParallelLinear``, ``GPTModel``, Megatron DDP, ``finalize_model_grads``
and the no-pipelining and 1F1B schedules run in a gloo world, which is how knitkit's own tests and
``knitkit.integration.megatron.testing`` check gradient equivalence on a CPU-only machine.

Usage on every rank of an initialised gloo world::

    from knitkit.integration.megatron import cpu

    cpu.initialize_model_parallel(tensor_parallel=2)
    cpu.install_schedule_shim()            # get_forward_backward_func() and Megatron DDP
    layer = ColumnParallelLinear(8, 16, config=cpu.model_parallel_config(), ...)
    ...
    cpu.destroy_model_parallel()

Extend it by ADDING ``install_*`` functions, one documented job each; never patch more than the
one call megatron makes. Tested against megatron-core 0.16.1 (the line numbers below are its).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec

_installed = False


def install() -> None:
    """Patch the CUDA assumptions megatron-core makes on the allocation path (idempotent).

    ``torch.cuda.current_device`` returns ``"cpu"`` so ``torch.empty(..., device=current_device())``
    allocates on the CPU (megatron's mappings and layers use it for gather buffers).
    On a machine with CUDA nothing is patched: megatron-core then runs as it does in production.
    """
    global _installed
    if _installed or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    _installed = True


def initialize_model_parallel(
    tensor_parallel: int = 1, context_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0
) -> None:
    """``parallel_state.initialize_model_parallel`` on the current gloo world, plus a CPU RNG tracker.

    Any earlier model-parallel state is destroyed first, so one spawned world can host many layouts.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    install()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        context_parallel_size=context_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
    )
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tp_random.model_parallel_cuda_manual_seed(seed)
    else:
        # The CUDA RNG tracker cannot seed on CPU; the inference tracker's fork() is a
        # no-op, which is all TP layers need when initialised on CPU from torch's global seed.
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def destroy_model_parallel() -> None:
    """Tear down the groups made by ``initialize_model_parallel``."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def model_parallel_config(**overrides: object) -> object:
    """A ``ModelParallelConfig`` matching the current parallel state, initialised on the CPU."""
    from megatron.core import ModelParallelConfig, parallel_state

    kwargs: dict[str, object] = {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "use_cpu_initialization": True,
        "perform_initialization": True,
    }
    kwargs.update(overrides)
    return ModelParallelConfig(**kwargs)


class _SchedulesTorch:
    """Stands in for ``torch`` inside megatron's ``schedules.py``: ``zeros(device="cuda")`` lands on the CPU."""

    def __getattr__(self, name: str) -> object:
        if name == "zeros":
            return _zeros_on_cpu
        return getattr(torch, name)


def _zeros_on_cpu(*args: object, **kwargs: object) -> torch.Tensor:
    kwargs["device"] = "cpu"
    return torch.zeros(*args, **kwargs)  # type: ignore[call-overload]


def install_schedule_shim() -> None:
    """Let ``get_forward_backward_func()`` schedules and Megatron DDP run on CPU (idempotent).

    On top of ``install()``: the no-pipelining schedule allocates its token counter with
    ``torch.zeros(..., device="cuda")`` (schedules.py L596 in 0.16.1); only that module's
    ``torch`` is proxied, so nothing else changes. DDP's grad buffers use
    ``torch.cuda.current_device()`` and are covered by ``install()``. Call it after
    ``initialize_model_parallel`` (which sets up the CPU RNG tracker). No-op with CUDA.
    """
    install()
    if torch.cuda.is_available():
        return
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _SchedulesTorch):
        schedules.torch = _SchedulesTorch()


class _CudaIsCpu(torch.Tensor):
    """A tensor whose ``.cuda()`` stays on the CPU and returns a plain tensor."""

    def cuda(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


class _VisionTorch:
    """Stands in for ``torch`` inside megatron's ``clip_vit_model.py``: ``arange(...).cuda()`` stays on the CPU."""

    def __getattr__(self, name: str) -> object:
        if name == "arange":
            return _arange_on_cpu
        return getattr(torch, name)


def _arange_on_cpu(*args: object, **kwargs: object) -> torch.Tensor:
    return torch.arange(*args, **kwargs).as_subclass(_CudaIsCpu)  # type: ignore[call-overload]


def install_vision_shim() -> None:
    """Let megatron's ``CLIPViTModel`` (and so ``LLaVAModel``) build on CPU (idempotent; no-op with CUDA).

    ``CLIPViTModel.__init__`` moves its position ids with ``.cuda()`` (clip_vit_model.py L124 in
    0.16.1); only that module's ``torch`` is proxied, so its ``arange`` results stay on the CPU.
    The local ViT spec attends causally without a mask, and the softmax then builds its default
    causal mask with ``device="cuda"`` (transformer/utils.py L35): ``fused_softmax``'s reference
    to it is pointed at a CPU twin.
    """
    install()
    if torch.cuda.is_available():
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.vision import clip_vit_model

    if not isinstance(clip_vit_model.torch, _VisionTorch):
        clip_vit_model.torch = _VisionTorch()
    fused_softmax.get_default_causal_mask = _causal_mask_on_cpu


def _causal_mask_on_cpu(sq: int) -> torch.Tensor:
    return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)


class SequenceParallelNorm(torch.nn.LayerNorm):
    """torch ``LayerNorm`` built like megatron's norms, tagging its parameters as apex/TE norms do.

    megatron-core's own torch norm refuses ``sequence_parallel`` (CPU CI has neither apex nor TE);
    a norm is per token, so only the ``sequence_parallel`` tag is missing: with it,
    ``finalize_model_grads`` sums the norm's gradients over TP, as in production.
    """

    def __init__(self, config: object, hidden_size: int, eps: float = 1e-5, **unused: object):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = getattr(config, "sequence_parallel", False)  # type: ignore[attr-defined]


def sequence_parallel_block_spec(qk_layernorm: bool = False) -> object:
    """``block_spec(num_layers)`` for megatron's local layer spec with ``SequenceParallelNorm`` norms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return _sequence_parallel_blocks(
        get_gpt_layer_local_spec(qk_layernorm=qk_layernorm), qk_layernorm
    )


def _sequence_parallel_blocks(layer: ModuleSpec, qk_layernorm: bool) -> object:
    """``block_spec(num_layers)`` repeating ``layer`` with every norm a ``SequenceParallelNorm``
    (the q/k norms too when ``qk_layernorm``, else identities)."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    attention = layer.submodules.self_attention
    norm_or_identity = SequenceParallelNorm if qk_layernorm else IdentityOp
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(
            attention.submodules, q_layernorm=norm_or_identity, k_layernorm=norm_or_identity
        ),
    )
    layer = dataclasses.replace(
        layer,
        submodules=dataclasses.replace(
            layer.submodules,
            input_layernorm=SequenceParallelNorm,
            pre_mlp_layernorm=SequenceParallelNorm,
            self_attention=attention,
        ),
    )

    def block(num_layers: int) -> object:
        return TransformerBlockSubmodules(
            layer_specs=[layer] * num_layers, layer_norm=SequenceParallelNorm
        )

    return block


class _CpuCuda:
    """``torch.cuda`` with ``synchronize`` as a no-op (gloo p2p on CPU has nothing to wait for)."""

    def __getattr__(self, name: str) -> object:
        if name == "synchronize":
            return lambda *args, **kwargs: None
        return getattr(torch.cuda, name)


class _P2PTorch:
    """Stands in for ``torch`` inside megatron's ``p2p_communication.py``: see ``_CpuCuda``."""

    def __getattr__(self, name: str) -> object:
        if name == "cuda":
            return _CpuCuda()
        return getattr(torch, name)


def install_pipeline_shim() -> None:
    """Let the pipeline schedules exchange variable-length activations on CPU (idempotent).

    On top of ``install_schedule_shim()``: with ``variable_seq_lengths=True`` megatron's p2p
    communicator exchanges shapes first and then calls ``torch.cuda.synchronize()``
    unconditionally (p2p_communication.py L242 in 0.16.1); only that module's ``torch`` is
    proxied. Use ``TransformerConfig(batch_p2p_comm=False)`` as well. No-op with CUDA.
    """
    install_schedule_shim()
    if torch.cuda.is_available():
        return
    from megatron.core.pipeline_parallel import p2p_communication

    if not isinstance(p2p_communication.torch, _P2PTorch):
        p2p_communication.torch = _P2PTorch()


def install_moe_shim() -> None:
    """Let megatron's MoE router run without Transformer Engine (idempotent; no-op with TE).

    megatron-core 0.16.1's ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``,
    a name ``moe_utils.py`` binds only when its TE import succeeds (L34), so without TE every
    router forward raises ``NameError``; binding it to ``None`` selects the ``torch.mm`` path
    written for that case.
    """
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_block_spec(num_experts: int) -> object:
    """``block_spec(num_layers)`` for megatron's local MoE layer spec with ``SequenceParallelNorm`` norms
    (megatron refuses MoE training at TP > 1 without sequence parallelism)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    return _sequence_parallel_blocks(layer, qk_layernorm=False)


def install_recompute_shim() -> None:
    """Let megatron's activation recompute (``recompute_granularity``) run on CPU (idempotent;
    no-op with CUDA).

    ``CheckpointFunction`` saves and restores the CUDA RNG state around the recomputed forward
    (``_get_all_rng_states`` / ``_set_all_rng_states`` in ``tensor_parallel/random.py``), which
    raises without CUDA; on CPU there is no CUDA RNG to keep (dropout draws from torch's CPU
    generator, saved and restored beside it), so the two CUDA calls become no-ops.
    """
    install()
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
