"""megatron-core's LLaVAModel under knitkit: gradient equivalence with the unwrapped LLaVA step (gloo on CPU).

The reference is the user's LLaVA step as megatron-core runs it: per micro-batch,
``LLaVAModel.forward(images, input_ids, ...)`` over LLaVA's own inputs (one image token per image,
text-length labels and loss mask, images re-encoded by every micro-batch that uses them), the same
sequences packed in the same order with a block-causal mask over the combined rows. The wrapped
step stores the write-time expansion (``llava_sequence``), encodes each unique image once per
mini-batch through LLaVA's vision path (``LLaVADedup.encode``: ViT, class-token drop, pixel
shuffle, projector) and feeds the language model the routed rows. Both run twin models, two
mini-batches with an SGD update between them.

Tolerance (fp32): per parameter, ``max|g_wrapped - g_ref| <= 1e-5 + 1e-4 * max|g_ref|`` (the two
differ only in summation order: image-row gradients summed over micro-batches and ranks before
one backward through the ViT). The worst excess is printed per test (``-s``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import megatron_cpu
import numpy as np
import pytest
import torch
from dist import World

from knitkit.storage import MicroBatchPlan
from knitkit.storage.planning import SequenceSlice

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import megatron_llava as user

ATOL, RTOL = 1e-5, 1e-4
STEPS, LR = 2, 0.5


def _reference_batches(
    samples: dict[str, user.Sample],
    micro_batches: Sequence[MicroBatchPlan],
    thd: bool,
    device: torch.device,
) -> Iterator[dict[str, Any]]:
    """LLaVA's own inputs for the same packed micro-batches: text-length ids, images re-encoded.

    Each sequence gets the plan's padding as trailing text tokens 0 (loss-masked), so LLaVA's
    combined rows line up with knitkit's packed ones; with ``thd`` (TE) the batch carries
    ``PackedSeqParams`` over the combined rows (LLaVA then CP-splits itself), else a block-causal mask.
    """
    from knitkit.integration.megatron import block_causal_mask, packed_seq_params

    def padded(seq: SequenceSlice, values: np.ndarray) -> np.ndarray:
        return np.concatenate([values, np.zeros(seq.padded_length - seq.num_tokens, values.dtype)])

    for mb in micro_batches:
        seqs = [(s, samples[s.trajectory_id]) for s in mb.sequences]
        images = [tiles for _, s in seqs for tiles in s.images]
        batch: dict[str, Any] = {
            name: torch.from_numpy(
                np.concatenate([padded(plan, getattr(s, name)) for plan, s in seqs])
            )[None].to(device)
            for name in ("input_ids", "labels", "loss_mask")
        }
        batch["images"] = torch.from_numpy(np.concatenate(images)).to(device)
        batch["num_image_tiles"] = torch.tensor(
            [len(t) for t in images], dtype=torch.int, device=device
        )
        lengths = torch.tensor([plan.padded_length for plan, _ in seqs])
        if thd:
            real = torch.tensor([0] + [plan.num_tokens for plan, _ in seqs]).cumsum(0)
            batch["packed_seq_params"] = packed_seq_params(
                real.to(device),
                torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device),
            )
            batch["attention_mask"] = None
        else:
            batch["packed_seq_params"] = None
            batch["attention_mask"] = block_causal_mask(lengths).to(device)
        yield batch


def _reference_step(
    data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    """The user's unwrapped LLaVA forward step."""
    batch = next(data_iterator)
    output, loss_mask = model(
        batch["images"],
        batch["input_ids"],
        None,
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        num_image_tiles=batch["num_image_tiles"],
        packed_seq_params=batch["packed_seq_params"],
    )
    return output, functools.partial(user.loss_func, loss_mask)


def _equivalence(
    rank: int,
    tensor_parallel: int,
    overlap: bool,
    prompts: int = 4,
    n: int = 4,
    use_te: bool = False,
    context_parallel: int = 1,
) -> dict[str, object]:
    """One rank: the unwrapped LLaVA step and the knitkit step on twin models; gradient excess."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from knitkit.integration.megatron import LLaVADedup, MegatronLayout
    from knitkit.storage import MemoryBackend, TrajectoryStore

    megatron_cpu.initialize_model_parallel(
        tensor_parallel=tensor_parallel, context_parallel=context_parallel
    )
    megatron_cpu.install_schedule_shim()
    megatron_cpu.install_vision_shim()
    try:
        layout = MegatronLayout.from_parallel_state()
        reference = user.build_model(overlap, use_te=use_te)
        wrapped = user.build_model(overlap, use_te=use_te)
        llava = LLaVADedup(wrapped)
        store = TrajectoryStore(MemoryBackend())
        device = user._device()
        encode = llava.encode_fn(lambda key: torch.from_numpy(store.read(key)).to(device))
        worst: dict[str, float] = {}
        worst_relative = 0.0
        encoded = reference_tiles = 0
        for mini_batch in range(STEPS):
            samples = user.grpo_samples(seed=mini_batch, prompts=prompts, n=n)
            ids = user.write(store, samples)
            plan = user.plan_step(store, ids, layout)
            consumer = plan.consumer(*layout.coord[:2])

            reference.zero_grad_buffer()
            by_id = {s.trajectory_id: s for s in samples}
            data = list(_reference_batches(by_id, consumer.micro_batches, use_te, device))
            reference_tiles += sum(len(b["images"]) for b in data)
            get_forward_backward_func()(
                forward_step_func=_reference_step,
                data_iterator=iter(data),
                model=[reference],
                num_microbatches=plan.num_micro_batches,
                seq_length=user.MAX_SEQ,
                micro_batch_size=1,
            )

            wrapped.zero_grad_buffer()
            iterator, batches = user.knitkit_batches(store, plan, layout, use_te=use_te)
            with iterator:
                llava.step.run(
                    forward_step_func=functools.partial(user.forward_step, llava=llava),
                    data_iterator=batches,
                    route=layout.route(plan),
                    encode_fn=encode,
                    num_microbatches=plan.num_micro_batches,
                    seq_length=user.MAX_SEQ,
                    micro_batch_size=1,
                )
            encoded += llava.step.last_encoded_units

            for (name, ref), mine in zip(
                reference.module.named_parameters(), wrapped.module.parameters(), strict=True
            ):
                diff = float((mine.main_grad - ref.main_grad).abs().max())
                scale = float(ref.main_grad.abs().max())
                worst[name] = max(worst.get(name, -1.0), diff - RTOL * scale)
                worst_relative = max(worst_relative, diff / max(scale, 1e-12))
                for param in (ref, mine):
                    param.data.add_(param.main_grad, alpha=-LR)
        restored = wrapped.module.vision_projection is llava._projection and list(
            wrapped.module.state_dict()
        ) == list(reference.module.state_dict())  # the checkpoint's keys stay the user's
        return {
            "worst_excess": worst,
            "worst_relative": worst_relative,
            "encoded": encoded,
            "reference_tiles": reference_tiles,
            "restored": restored,
        }
    finally:
        megatron_cpu.destroy_model_parallel()


def _check(results: list[dict[str, object]], tensor_parallel: int, prompts: int = 4) -> None:
    for rank, result in enumerate(results):
        worst = result["worst_excess"]
        assert isinstance(worst, dict)
        assert any(n.startswith("vision_model.") for n in worst)
        assert any(n.startswith("vision_projection.") for n in worst)
        assert result["restored"], (
            f"rank {rank}: vision_projection not restored or state_dict keys changed"
        )
        bad = {name: excess for name, excess in worst.items() if excess > ATOL}
        assert not bad, f"rank {rank}: gradients beyond {ATOL} + {RTOL}*max|g_ref|: {bad}"
    print(f"worst relative gradient error: {max(float(r['worst_relative']) for r in results):.2e}")  # type: ignore[arg-type]
    # Each unique image is encoded once per mini-batch by every TP peer of one DP group; the
    # reference runs the ViT on every tile of every micro-batch on every rank.
    encoded = sum(int(r["encoded"]) for r in results)  # type: ignore[call-overload]
    expected = sum(len(user.unique_images(s, prompts)) for s in range(STEPS)) * tensor_parallel
    assert encoded == expected, (encoded, expected)
    assert sum(int(r["reference_tiles"]) for r in results) > encoded  # type: ignore[call-overload]


def _expansion(rank: int) -> list[bool]:
    """``llava_sequence`` vs ``LLaVAModel._preprocess_data`` on the same sample (tokens, labels, mask)."""
    from megatron.core.models.multimodal.llava_model import IGNORE_INDEX

    from knitkit.integration.megatron import llava_sequence
    from knitkit.integration.megatron.llava import IGNORE_INDEX as knitkit_ignore

    megatron_cpu.initialize_model_parallel()
    megatron_cpu.install_vision_shim()
    try:
        model = user.build_model(use_te=False).module
        rng = np.random.default_rng(7)
        checks = []
        for sample in user.grpo_samples(seed=3, prompts=3, n=2):
            for first_is_image in (False, True):
                ids, labels, mask = sample.input_ids, sample.labels, sample.loss_mask
                if first_is_image:  # an image token first, and a loss-masked prefix varied
                    ids, labels = np.append(user.IMAGE_TOKEN, ids), np.append(ids[0], labels)
                    mask = np.append(1.0, (rng.random(len(mask)) > 0.3)).astype(np.float32)
                    images = (np.zeros((2, 3, user.IMG, user.IMG), np.float32), *sample.images)
                else:
                    images = sample.images
                tiles = torch.tensor([len(i) for i in images], dtype=torch.int)
                rows = int(tiles.sum()) * user.IMG_SEQ_LEN
                h = user.HIDDEN
                text = torch.arange(len(ids), dtype=torch.float32)[None, :, None].expand(1, -1, h)
                embedding, ref_labels, ref_mask = model._preprocess_data(
                    -torch.arange(1, rows + 1, dtype=torch.float32)[:, None, None]
                    .expand(-1, 1, h)
                    .reshape(user.IMG_SEQ_LEN, int(tiles.sum()), h)
                    .contiguous(),
                    text.contiguous(),
                    torch.from_numpy(ids)[None],
                    torch.from_numpy(mask)[None],
                    torch.from_numpy(labels)[None],
                    False,
                    None,
                    user.IMAGE_TOKEN,
                    tiles,
                )
                seq = llava_sequence(
                    ids,
                    labels,
                    mask,
                    img_seq_len=user.IMG_SEQ_LEN,
                    image_token_index=user.IMAGE_TOKEN,
                    tiles=tiles.tolist(),
                )
                is_image = embedding[:, 0, 0] < 0  # image rows carry negative markers
                image_rows = torch.zeros(len(seq.tokens), dtype=torch.bool)
                for start, count in seq.image_spans:
                    image_rows[start : start + count] = True
                text_ids = torch.from_numpy(ids)[embedding[~is_image, 0, 0].long()]
                checks += [
                    bool(torch.equal(is_image, image_rows)),
                    bool(torch.equal(torch.from_numpy(seq.tokens)[~image_rows], text_ids)),
                    bool((torch.from_numpy(seq.tokens)[image_rows] == user.IMAGE_TOKEN).all()),
                    bool(torch.equal(torch.from_numpy(seq.labels), ref_labels[0])),
                    bool(torch.equal(torch.from_numpy(seq.loss_mask), ref_mask[0])),
                ]
        checks.append(knitkit_ignore == IGNORE_INDEX)
        return checks
    finally:
        megatron_cpu.destroy_model_parallel()


def _example(rank: int, steps: int) -> list[dict[str, float]]:
    megatron_cpu.initialize_model_parallel(tensor_parallel=2)
    megatron_cpu.install_schedule_shim()
    megatron_cpu.install_vision_shim()
    try:
        return user.train(steps=steps, use_te=False)
    finally:
        megatron_cpu.destroy_model_parallel()


@pytest.fixture(scope="module")
def world2() -> Iterator[World]:
    with World(2, timeout_s=300) as world:
        yield world


def test_llava_expansion_matches_preprocess_data(world2: World) -> None:
    """Write-time expansion = LLaVA's in-model expansion: image rows, text ids, labels, loss mask."""
    for checks in world2.run(_expansion):
        assert checks and all(checks), checks


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
def test_llava_tp2_matches_unwrapped(world2: World, overlap: bool) -> None:
    """TP=2: every ViT, projector and language-model gradient equals the unwrapped LLaVA step's."""
    _check(world2.run(_equivalence, 2, overlap), 2)


def test_llava_dp2_matches_unwrapped(world2: World) -> None:
    """DP=2 (TP=1): images encoded on one DP rank and routed to the other; same gradients."""
    _check(world2.run(_equivalence, 1, True), 1)


@pytest.mark.slow
def test_llava_dp2_tp2_matches_unwrapped() -> None:
    """DP=2 x TP=2: TP peers encode together, rows routed across DP; same gradients."""
    with World(4, timeout_s=300) as world:
        _check(world.run(_equivalence, 2, True), 2)


def test_llava_dp2_rank_with_nothing_to_encode(world2: World) -> None:
    """One image over 2 encoding DP ranks, overlap on: the idle rank's ViT and projector still
    satisfy DDP's buckets (both modules get the zero anchor), and gradients match."""
    _check(world2.run(_equivalence, 1, True, 1, 8), 1, prompts=1)


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _te() -> bool:
    from knitkit.integration.megatron import te_available

    return te_available()


@pytest.mark.cuda
@pytest.mark.parametrize(("tp", "cp"), [(2, 1), (2, 2)], ids=["tp2", "cp2_tp2"])
def test_llava_te_thd_matches_unwrapped_nccl(tp: int, cp: int) -> None:
    """With TE (THD attention, PackedSeqParams): TP=2, and CP=2 x TP=2 where LLaVA CP-splits its
    own combined sequence and knitkit hands each rank its chunks; same gradients."""
    if _cuda_devices() < tp * cp or not _te():
        pytest.skip(
            f"needs CUDA with {tp * cp} GPUs and Transformer Engine (pip install 'knitkit[te]')"
        )
    with World(tp * cp, backend="nccl", timeout_s=600) as world:
        _check(world.run(_equivalence, tp, True, 4, 4, True, cp), tp)


def test_llava_example_trains_with_dedup(world2: World) -> None:
    """examples/megatron_llava.py at TP=2: the loss falls; each unique image encoded once per TP peer."""
    history = world2.run(_example, 3)
    assert history[0] == history[1], "TP ranks must agree on the reduced figures"
    losses = [step["loss"] for step in history[0]]
    assert losses[0] > losses[1] > losses[2], losses
    assert all(step["encoded_units"] == 2 * len(user.unique_images(0)) for step in history[0])
