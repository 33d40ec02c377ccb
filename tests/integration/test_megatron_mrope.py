"""A Qwen-VL style mRoPE model under knitkit: stored 3-D positions and gradient equivalence (gloo on CPU).

Positions: ``mrope_positions`` must equal Qwen2.5-VL's ``get_rope_index`` (a transcription of its
loop is the reference here), and after store -> plan (CP split) -> pack, every packed position row
must be the reference row of its token; ``mrope_position_ids`` places a CP rank's rows at their
full-sequence offsets, where megatron's THD RoPE reads them.

Gradients: ``knitkit.integration.megatron.testing.check_equivalence`` on the same model with and
without dedup (the reference hands every micro-batch the image pieces it consumes, so each is
re-encoded in every micro-batch), the same mini-batch twice with an SGD update between. Tolerance
(fp32): per parameter ``max|g_dedup - g_ref| <= 1e-4 * max(max|g_ref|, 1e-6)``; every reference
gradient is above the floor and the worst relative error is asserted (table printed with ``-s``).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dist import World
from unwrapped_batches import with_images

from knitkit.integration.megatron import cpu as megatron_cpu

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import megatron_mrope as user

from knitkit.encoder_dedup import EquivalenceReport
from knitkit.integration.megatron import (
    MROPE_FIELD,
    mrope_batch,
    mrope_position_ids,
    mrope_positions,
)
from knitkit.integration.megatron.testing import VLMUnderTest, check_equivalence
from knitkit.storage import (
    MemoryBackend,
    PlannerConfig,
    Topology,
    Trajectory,
    TrajectoryStore,
    pack,
    plan_minibatch,
)
from knitkit.storage.planning import cp_chunks

WORLD_TIMEOUT_S = 300.0
"""Default limit of one job on this module's lent worlds (``world2``/``world4`` in tests/conftest.py)."""

RTOL, FLOOR = 1e-4, 1e-6
STEPS, LR = 2, 0.5


def _get_rope_index(
    input_ids: torch.Tensor, grids: torch.Tensor, image_token: int, merge: int
) -> torch.Tensor:
    """Qwen2.5-VL ``get_rope_index`` for one sequence of images (transformers' loop, transcribed)."""
    input_tokens = input_ids.tolist()
    llm_pos_ids_list: list[torch.Tensor] = []
    st = 0
    for t, h, w in grids.tolist():
        ed = input_tokens.index(image_token, st)
        second_per_grid_t = 0  # images
        llm_grid_t, llm_grid_h, llm_grid_w = t, h // merge, w // merge
        text_len = ed - st
        st_idx = llm_pos_ids_list[-1].max() + 1 if llm_pos_ids_list else 0
        llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
        range_tensor = torch.arange(llm_grid_t).view(-1, 1)
        expanded_range = range_tensor.expand(-1, llm_grid_h * llm_grid_w)
        t_index = (expanded_range * second_per_grid_t * 2).long().flatten()
        h_index = (
            torch.arange(llm_grid_h).view(1, -1, 1).expand(llm_grid_t, -1, llm_grid_w).flatten()
        )
        w_index = (
            torch.arange(llm_grid_w).view(1, 1, -1).expand(llm_grid_t, llm_grid_h, -1).flatten()
        )
        llm_pos_ids_list.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
        st = ed + llm_grid_t * llm_grid_h * llm_grid_w
    if st < len(input_tokens):
        st_idx = llm_pos_ids_list[-1].max() + 1 if llm_pos_ids_list else 0
        text_len = len(input_tokens) - st
        llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
    return torch.cat(llm_pos_ids_list, dim=1)


def _grids(trajectory: Trajectory) -> list[tuple[int, int, int]]:
    """Each image unit's grid_thw: its stored shape ``[t, h, w, dim]``."""
    return [
        (int(i.data.shape[0]), int(i.data.shape[1]), int(i.data.shape[2]))
        for i in trajectory.multimodal
    ]


def test_mrope_positions_match_get_rope_index() -> None:
    """Text advances all three axes; an image spreads over its merged grid after the text before it."""
    tokens = np.array([1, 5, 3, 3, 3, 3, 6, 7, 3, 3, 8], dtype=np.int64)
    got = mrope_positions(tokens, [(1, 4, 4), (1, 2, 4)], image_token_id=3, spatial_merge_size=2)
    expected = np.array(
        [
            [0, 1, 2, 2, 2, 2, 4, 5, 6, 6, 8],
            [0, 1, 2, 2, 3, 3, 4, 5, 6, 6, 8],
            [0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8],
        ]
    )
    np.testing.assert_array_equal(got, expected)
    for seed in range(3):
        for trajectory in user.grpo_trajectories(seed):
            tokens = trajectory.token_fields["tokens"]
            reference = _get_rope_index(
                torch.from_numpy(tokens),
                torch.tensor(_grids(trajectory)),
                user.IMAGE_TOKEN,
                user.MERGE,
            )
            np.testing.assert_array_equal(trajectory.token_fields[MROPE_FIELD].T, reference.numpy())


def test_mrope_positions_refuse_missing_image_tokens() -> None:
    """A grid whose tokens are not all in the sequence is an error naming the grid."""
    with pytest.raises(ValueError, match=r"\(1, 4, 4\) needs 4 image tokens"):
        mrope_positions(np.array([1, 3, 3, 2]), [(1, 4, 4)], image_token_id=3)


@pytest.mark.parametrize("cp", [1, 2])
def test_packed_mrope_positions_equal_reference_per_sequence(cp: int) -> None:
    """Through store -> plan (CP split) -> pack, each packed position row is its token's reference row."""
    store = TrajectoryStore(MemoryBackend())
    trajectories = user.grpo_trajectories(seed=5)
    for trajectory in trajectories:
        store.write(trajectory)
    by_id = {t.trajectory_id: t for t in trajectories}
    plan = plan_minibatch(
        store.metas(list(by_id)),
        Topology(dp=2, cp=cp),
        PlannerConfig(token_fields=("tokens", MROPE_FIELD), scalar_fields=(), min_micro_batches=2),
    )
    checked = 0
    for dp in range(2):
        for rank in range(cp):
            for mb in plan.consumer(dp, rank).micro_batches:
                layout, buffer = pack(
                    mb, store.schema(trajectories[0].trajectory_id), store.read_into
                )
                views = layout.numpy_views(buffer)
                packed = torch.from_numpy(views[MROPE_FIELD].copy())
                cu_padded = torch.from_numpy(views["cu_seqlens_padded"].copy())
                model_ids = mrope_position_ids(packed, cu_padded, cp, rank)
                offset = 0
                for seq in mb.sequences:
                    trajectory = by_id[seq.trajectory_id]
                    reference = _get_rope_index(
                        torch.from_numpy(trajectory.token_fields["tokens"]),
                        torch.tensor(_grids(trajectory)),
                        user.IMAGE_TOKEN,
                        user.MERGE,
                    )
                    whole = torch.zeros(3, seq.padded_length, dtype=torch.int64)
                    whole[:, : seq.num_tokens] = reference
                    mine = torch.cat(
                        [whole[:, a:b] for a, b in cp_chunks(seq.padded_length, cp, rank)], 1
                    )
                    piece = packed[offset : offset + seq.local_length].t()
                    assert torch.equal(piece, mine), seq.trajectory_id
                    start = int(cu_padded[mb.sequences.index(seq)])
                    for a, b in cp_chunks(seq.padded_length, cp, rank):  # THD RoPE reads these rows
                        assert torch.equal(model_ids[:, 0, start + a : start + b], whole[:, a:b])
                    offset += seq.local_length
                    checked += 1
    assert checked == len(trajectories) * cp


def _equivalence(
    rank: int, tensor_parallel: int, overlap: bool, use_te: bool = False, context_parallel: int = 1
) -> EquivalenceReport:
    """One rank of ``check_equivalence``: the model without dedup and with it, twin builds."""
    from megatron.core import parallel_state

    megatron_cpu.initialize_model_parallel(
        tensor_parallel=tensor_parallel, context_parallel=context_parallel
    )
    megatron_cpu.install_schedule_shim()
    try:
        to_batch = functools.partial(
            mrope_batch,
            use_te=use_te,
            cp_size=context_parallel,
            cp_rank=parallel_state.get_context_parallel_rank(),
        )
        subject = VLMUnderTest(
            provider=functools.partial(user.build_model, overlap, use_te=use_te),
            forward_step=user.forward_step,
            tp_sharded_vision=True,
            to_batch=to_batch,
            reference_batches=with_images,
            token_fields=("tokens", "labels", "loss_mask", MROPE_FIELD),
        )
        return check_equivalence(
            subject,
            functools.partial(user.grpo_trajectories, 0),
            rtol=RTOL,
            floor=FLOOR,
            steps=STEPS,
            lr=LR,
        )
    finally:
        megatron_cpu.destroy_model_parallel()


def _check(results: list[EquivalenceReport], tensor_parallel: int) -> None:
    report = results[0]
    print(report.table())
    report.raise_if_failed(expect_below_floor=())
    assert report.worst_relative_error <= RTOL, report.worst_relative_error
    assert any(c.name.startswith("vision.") and c.status == "ok" for c in report.gradients)
    unique = len({i.key for t in user.grpo_trajectories(0) for i in t.multimodal})
    assert report.units_with_dedup == unique * STEPS * tensor_parallel  # TP peers encode together
    assert report.units_without_dedup > report.units_with_dedup


def test_mrope_tp2_matches_without_dedup(world2: World) -> None:
    """TP=2, overlap on: every vision and language-model gradient equals the non-dedup model's."""
    _check(world2.run(_equivalence, 2, True), 2)


@pytest.mark.slow
def test_mrope_dp2_tp2_matches_without_dedup(world4: World) -> None:
    """DP=2 x TP=2: TP peers encode together, rows routed across DP; same gradients."""
    _check(world4.run(_equivalence, 2, True), 2)


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.parametrize(("tp", "cp"), [(2, 1), (2, 2)], ids=["tp2", "cp2_tp2"])
def test_mrope_te_thd_matches_without_dedup_nccl(tp: int, cp: int) -> None:
    """With TE (THD attention): TP=2, and CP=2 x TP=2 where each rank's stored positions are placed
    at their full-sequence offsets for megatron's THD RoPE; same gradients as without dedup."""
    from knitkit.integration.megatron import te_available

    if _cuda_devices() < tp * cp or not te_available():
        pytest.skip(
            f"needs CUDA with {tp * cp} GPUs and Transformer Engine (pip install 'knitkit[te]')"
        )
    with World(tp * cp, backend="nccl", timeout_s=600) as world:
        _check(world.run(_equivalence, tp, True, True, cp), tp)
