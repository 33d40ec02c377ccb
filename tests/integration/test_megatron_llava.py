"""megatron-core's LLaVAModel under knitkit: gradient equivalence with the unwrapped LLaVA step (gloo on CPU).

The reference is the user's LLaVA step as megatron-core runs it: per micro-batch,
``LLaVAModel.forward(images, input_ids, ...)`` over LLaVA's own inputs (one image token per image,
text-length labels and loss mask, images re-encoded by every micro-batch that uses them), the same
sequences packed in the same order with a block-causal mask over the combined rows. The wrapped
step stores the write-time expansion (``llava_sequence``), encodes each unique image once per
mini-batch through LLaVA's vision path (``LLaVADedup.encode``: ViT, class-token drop, pixel
shuffle, projector) and feeds the language model the routed rows. Both run twin models, two
mini-batches with an SGD update between them.

Each case is ``knitkit.integration.megatron.testing.check_equivalence`` with LLaVA's own step as
the reference (``reference_batches``, ``reference_forward_step``). Tolerance (fp32): per parameter,
``max|g_wrapped - g_ref| <= 1e-4 * max(max|g_ref|, 1e-6)`` (the two differ only in summation
order: image-row gradients summed over micro-batches and ranks before one backward through the
ViT); the worst relative error is asserted, and the parameters whose reference gradient is below
the floor are stated (``BELOW_FLOOR``). The table is printed per test (``-s``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist import World

from knitkit.encoder_dedup import EquivalenceReport
from knitkit.integration.megatron import batch_for
from knitkit.integration.megatron import cpu as megatron_cpu
from knitkit.integration.megatron.testing import VLMUnderTest, check_equivalence
from knitkit.storage import MicroBatchPlan, Trajectory
from knitkit.storage.planning import SequenceSlice
from knitkit.types import UnitKey

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import megatron_llava as user

WORLD_TIMEOUT_S = 300.0
"""Default limit of one job on this module's lent worlds (``world2``/``world4`` in tests/conftest.py)."""

RTOL, FLOOR = 1e-4, 1e-6
BELOW_FLOOR = ("vision_model.class_token",)
"""Parameters whose reference gradient is below FLOOR (compared only absolutely): the class token
is dropped after the one-layer ViT and reaches the loss only as a key/value of the patch rows'
attention, max|g_ref| ~1e-8 (its relative error, ~3e-7, is computed alike in both runs)."""
STEPS, LR = 2, 0.5


def _reference_batches(
    samples: dict[str, user.Sample],
    thd: bool,
    micro_batches: Sequence[MicroBatchPlan],
    batches: Iterable[Mapping[str, object]],
    load: Callable[[UnitKey], torch.Tensor],
) -> Iterator[dict[str, Any]]:
    """LLaVA's own inputs for the same packed micro-batches: text-length ids, images re-encoded.

    Each sequence gets the plan's padding as trailing text tokens 0 (loss-masked), so LLaVA's
    combined rows line up with knitkit's packed ones; with ``thd`` (TE) the batch carries
    ``PackedSeqParams`` over the combined rows (LLaVA then CP-splits itself), else a block-causal mask.
    """
    from knitkit.integration.megatron import block_causal_mask, current_device, packed_seq_params

    device = current_device()

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
    return output, functools.partial(user.common.loss_func, loss_mask)


def llava_forward_step(
    data_iterator: Iterator[Mapping[str, Any]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
    """The user's forward step under knitkit: ``LLaVADedup.forward(batch)`` for ``model(...)``."""
    from knitkit.integration.megatron import LLaVADedup

    return user.forward_step(data_iterator, model, llava=LLaVADedup(model))


def llava_encoder(chunk: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """LLaVA's vision path (ViT, class-token drop, pixel shuffle, projector) on one image's tiles."""
    from knitkit.integration.megatron import LLaVADedup

    return LLaVADedup(chunk).encode


class _Collected(list[Trajectory]):
    """Stands in for the store in ``user.write``: keeps the expanded trajectories."""

    def write(self, trajectory: Trajectory) -> None:
        self.append(trajectory)


def _equivalence(
    rank: int,
    tensor_parallel: int,
    overlap: bool,
    prompts: int = 4,
    n: int = 4,
    use_te: bool = False,
    context_parallel: int = 1,
) -> EquivalenceReport:
    """One rank of ``check_equivalence``: the unwrapped LLaVA step vs the knitkit step, twin models."""
    megatron_cpu.initialize_model_parallel(
        tensor_parallel=tensor_parallel, context_parallel=context_parallel
    )
    megatron_cpu.install_schedule_shim()
    megatron_cpu.install_vision_shim()
    try:
        samples = user.grpo_samples(seed=0, prompts=prompts, n=n)
        trajectories = _Collected()
        user.write(trajectories, samples)  # type: ignore[arg-type]
        by_id = {s.trajectory_id: s for s in samples}
        subject = VLMUnderTest(
            provider=functools.partial(user.build_model, overlap, use_te=use_te),
            forward_step=llava_forward_step,
            vision="vision_projection",
            vision_extra=("vision_model",),
            tp_sharded_vision=True,
            encoder=llava_encoder,
            to_batch=batch_for(use_te, context_parallel),
            reference_batches=functools.partial(_reference_batches, by_id, use_te),
            reference_forward_step=_reference_step,
        )
        return check_equivalence(subject, trajectories, rtol=RTOL, floor=FLOOR, steps=STEPS, lr=LR)
    finally:
        megatron_cpu.destroy_model_parallel()


def _check(results: list[EquivalenceReport]) -> None:
    report = results[0]
    print(report.table())
    report.raise_if_failed(expect_below_floor=BELOW_FLOOR)
    assert report.worst_relative_error <= RTOL, report.worst_relative_error
    for prefix in ("vision_model.", "vision_projection."):
        assert any(c.name.startswith(prefix) and c.status == "ok" for c in report.gradients)
    # Each unique image is encoded once per mini-batch by every TP peer of one DP group (the
    # check's expected count); the reference runs the ViT on every tile of every micro-batch.
    assert report.units_without_dedup > report.units_with_dedup


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


def test_llava_expansion_matches_preprocess_data(world2: World) -> None:
    """Write-time expansion = LLaVA's in-model expansion: image rows, text ids, labels, loss mask."""
    for checks in world2.run(_expansion):
        assert checks and all(checks), checks


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
def test_llava_tp2_matches_unwrapped(world2: World, overlap: bool) -> None:
    """TP=2: every ViT, projector and language-model gradient equals the unwrapped LLaVA step's."""
    _check(world2.run(_equivalence, 2, overlap))


def test_llava_dp2_matches_unwrapped(world2: World) -> None:
    """DP=2 (TP=1): images encoded on one DP rank and routed to the other; same gradients."""
    _check(world2.run(_equivalence, 1, True))


@pytest.mark.slow
def test_llava_dp2_tp2_matches_unwrapped(world4: World) -> None:
    """DP=2 x TP=2: TP peers encode together, rows routed across DP; same gradients."""
    _check(world4.run(_equivalence, 2, True))


def test_llava_dp2_rank_with_nothing_to_encode(world2: World) -> None:
    """One image over 2 encoding DP ranks, overlap on: the idle rank's ViT and projector still
    satisfy DDP's buckets (both modules get the zero anchor), and gradients match."""
    _check(world2.run(_equivalence, 1, True, 1, 8))


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
        _check(world.run(_equivalence, tp, True, 4, 4, True, cp))
