"""THD micro-batches from knitkit's prefetch iterator as Megatron forward-step tensors (one process)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from call_count import python_calls

from knitkit.integration.megatron import (
    PackedShapes,
    block_causal_mask,
    megatron_batch,
    megatron_batches,
    packed_seq_params,
)
from knitkit.microbatch_iter import MicroBatch, MicroBatchIterator, PackedMicroBatch
from knitkit.storage import (
    MemoryBackend,
    PlannerConfig,
    Topology,
    Trajectory,
    TrajectoryStore,
    pack,
    plan_minibatch,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

LENGTHS = {"a": 5, "b": 3, "c": 4}


def _micro_batches(
    topology: Topology,
    fields: tuple[str, ...] = ("tokens",),
    lengths: dict[str, int] = LENGTHS,
) -> list[MicroBatch]:
    store = TrajectoryStore(MemoryBackend())
    for name, length in lengths.items():
        tokens = np.arange(10, 10 + length, dtype=np.int64)
        per_token = {"tokens": tokens, "labels": tokens + 100}
        store.write(Trajectory(name, name, {f: per_token[f] for f in ("tokens", "labels")}))
    plan = plan_minibatch(
        store.metas(list(lengths)), topology, PlannerConfig(token_fields=fields, scalar_fields=())
    )
    consumer = plan.consumer(0, 0)
    packed = [
        PackedMicroBatch(*pack(mb, store.schema(next(iter(lengths))), store.read_into))
        for mb in consumer.micro_batches
    ]
    with MicroBatchIterator(packed) as iterator:
        return [
            MicroBatch(
                m.index,
                m.layout,
                m.flat.clone(),
                {k: v.clone() for k, v in m.tensors.items()},
                m.stats,
            )
            for m in iterator
        ]


def test_packed_seq_params_match_megatron_thd() -> None:
    """Our PackedSeqParams equal what megatron's get_thd_batch_on_this_cp_rank builds from the same cu_seqlens."""
    from megatron.core.utils import get_thd_batch_on_this_cp_rank

    cu = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    cu_padded = torch.tensor([0, 6, 10, 14], dtype=torch.int32)
    ours = packed_seq_params(cu, cu_padded)
    _, theirs = get_thd_batch_on_this_cp_rank(
        {"tokens": torch.zeros(1, 14)}, cu, cu_padded, torch.tensor([6]), cp_size=1, cp_rank=0
    )
    for name in ("qkv_format", "max_seqlen_q", "max_seqlen_kv"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name


def test_block_causal_mask_keeps_attention_inside_each_sequence() -> None:
    """Position i may attend to j iff both lie in the same packed sequence and j <= i."""
    mask = block_causal_mask(torch.tensor([3, 2]))[0, 0]
    owner = [0, 0, 0, 1, 1]
    for i in range(5):
        for j in range(5):
            assert bool(mask[i, j]) == (owner[i] != owner[j] or j > i), (i, j)


def test_megatron_batch_shifts_labels_within_each_sequence() -> None:
    """Derived labels are the next token of the same sequence; each sequence's last token is masked out."""
    (micro_batch,) = _micro_batches(Topology(dp=1))
    batch = megatron_batch(micro_batch, attention_mask=True)
    tokens, labels, mask = batch["tokens"][0], batch["labels"][0], batch["loss_mask"][0]  # type: ignore[index]
    starts = np.cumsum([0, *LENGTHS.values()])
    order = list(micro_batch.layout.trajectory_ids)
    assert sorted(order) == sorted(LENGTHS)
    offset = 0
    for name in order:
        n = LENGTHS[name]
        assert torch.equal(labels[offset : offset + n - 1], tokens[offset + 1 : offset + n])
        assert (
            float(mask[offset + n - 1]) == 0.0
            and float(mask[offset : offset + n - 1].sum()) == n - 1
        )
        offset += n
    assert offset == int(starts[-1]) == tokens.numel()
    assert batch["attention_mask"].shape == (1, 1, offset, offset)  # type: ignore[union-attr]
    assert batch["packed_seq_params"].qkv_format == "thd"  # type: ignore[union-attr]


def test_megatron_batch_uses_stored_labels_and_requires_them_under_cp() -> None:
    """A stored 'labels' field wins; under CP, deriving labels is refused with a clear error."""
    (with_labels,) = _micro_batches(Topology(dp=1, cp=2), fields=("tokens", "labels"))
    batch = megatron_batch(with_labels, cp_size=2)
    real = batch["loss_mask"][0] > 0  # type: ignore[index]
    assert torch.equal(batch["labels"][0][real], batch["tokens"][0][real] + 100)  # type: ignore[index]
    (without,) = _micro_batches(Topology(dp=1, cp=2))
    with pytest.raises(ValueError, match="labels"):
        megatron_batch(without, cp_size=2)


def test_megatron_batches_converts_every_micro_batch() -> None:
    """The data iterator yields one Megatron batch per delivered micro-batch, in order."""
    micro_batches = _micro_batches(Topology(dp=1))
    batches = list(megatron_batches(micro_batches))
    assert len(batches) == len(micro_batches)
    assert all(
        torch.equal(b["tokens"][0], m["tokens"])
        for b, m in zip(batches, micro_batches, strict=True)
    )  # type: ignore[index]


def test_per_micro_batch_conversions_stay_off_the_intra_op_pool() -> None:
    """What the prefetch thread builds per micro-batch (the block-causal mask, each token's
    sequence for scalar fields, GRPO's per-token weights) is repeat_interleave's answer, built
    with neither repeat_interleave nor an ``x[ids]`` gather (NOTE [ Segment ids off the
    intra-op pool ]: milliseconds per call with two intra-op threads on a loaded host)."""
    from encoder_dedup.harness import pool_idioms
    from grpo.loss import token_weights

    (micro_batch,) = _micro_batches(Topology(dp=1))
    (cp_share,) = _micro_batches(Topology(dp=1, cp=2), fields=("tokens", "labels"))
    expected = []
    for mb, cp in ((micro_batch, 1), (cp_share, 2)):
        padded = mb["cu_seqlens_padded"]
        lengths = ((padded[1:] - padded[:-1]) // cp).long()
        expected.append(torch.repeat_interleave(torch.arange(len(lengths)), lengths))
    loss_mask = micro_batch["tokens"].remainder(3).ne(0).float()
    owner = expected[0]
    counts = torch.zeros(int(owner.max()) + 1).index_add_(0, owner, loss_mask)
    weights_expected = loss_mask / (counts.clamp(min=1)[owner] * 4)
    with pool_idioms() as calls:
        batch = megatron_batch(micro_batch, attention_mask=True)
        padded = micro_batch["cu_seqlens_padded"]
        weights = token_weights(loss_mask, padded[1:] - padded[:-1], 4)
    assert not calls, calls
    from knitkit.integration.megatron.batch import token_sequence_ids  # MegatronRank.batch's

    with pool_idioms() as calls:
        owners = [token_sequence_ids(micro_batch), token_sequence_ids(cp_share, 2)]
    assert not calls, calls
    assert all(torch.equal(o, e) for o, e in zip(owners, expected, strict=True))
    assert torch.equal(weights, weights_expected)
    mask = batch["attention_mask"][0, 0]  # type: ignore[index]
    causal = torch.ones(mask.shape, dtype=torch.bool).triu(1)
    assert torch.equal(mask, causal | (owner[:, None] != owner[None, :]))


def test_conversion_runs_no_python_per_sequence() -> None:
    """``megatron_batch`` enters as many Python frames for a micro-batch of 12 sequences as for
    one of 3: what it takes from the layout is built vectorised from the padded lengths (NOTE
    [ Conversion by layout ])."""
    (few,) = _micro_batches(Topology(dp=1), ("tokens", "labels"))
    many_lengths = {f"s{i}": 2 + i % 5 for i in range(12)}
    (many,) = _micro_batches(Topology(dp=1), ("tokens", "labels"), many_lengths)
    assert len(many.layout.cu_seqlens_padded) == 13
    megatron_batch(few, attention_mask=True)  # imports megatron's PackedSeqParams
    calls = [
        python_calls(lambda mb=mb: megatron_batch(mb, attention_mask=True)) for mb in (few, many)
    ]
    assert calls[0] == calls[1], calls


def test_a_repeated_layout_is_converted_from_its_cached_shape() -> None:
    """A micro-batch whose layout the rank converted before builds nothing of the layout again
    (no op over ``T x T`` elements, ``PackedShapes.built`` stays 1, fewer torch ops) and
    converts to what an uncached conversion gives."""
    from torch.utils._python_dispatch import TorchDispatchMode

    (micro_batch,) = _micro_batches(Topology(dp=1), ("tokens", "labels"))
    total = micro_batch["tokens"].shape[0]
    shapes = PackedShapes()

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            self.sizes.append(out.numel() if isinstance(out, torch.Tensor) else 0)
            return out

    runs = []
    for _ in range(2):
        with Ops() as ops:
            batch = megatron_batch(micro_batch, attention_mask=True, shapes=shapes)
        runs.append(ops.sizes)
    assert max(runs[0]) == total * total and max(runs[1]) < total * total, runs
    assert len(runs[1]) < len(runs[0]) and shapes.built == 1, (runs, shapes.built)
    fresh = megatron_batch(micro_batch, attention_mask=True)
    assert batch.keys() == fresh.keys()
    for key, value in fresh.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(batch[key], value), key  # type: ignore[arg-type]
    assert batch["packed_seq_params"] == fresh["packed_seq_params"]


def test_packed_shapes_keep_at_most_max_bytes() -> None:
    """``PackedShapes`` drops its oldest layouts past ``max_bytes``: converting the first layout
    again after a second that did not fit beside it builds it again."""
    (first,) = _micro_batches(Topology(dp=1), ("tokens", "labels"))
    (second,) = _micro_batches(Topology(dp=1), ("tokens", "labels"), {"x": 7, "y": 2})
    one = PackedShapes().get(first, attention_mask=True).nbytes()
    shapes = PackedShapes(max_bytes=one)
    for micro_batch in (first, first, second, first):
        shapes.get(micro_batch, attention_mask=True)
    assert shapes.built == 3
