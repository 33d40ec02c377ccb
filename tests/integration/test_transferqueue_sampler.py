"""knitkit admission as a TransferQueue sampler, against the real transfer_queue package and Ray."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

import pytest
import ray
import torch
import transfer_queue as tq
from omegaconf import DictConfig
from tensordict import TensorDict
from transfer_queue import StreamingDataLoader, StreamingDataset
from transfer_queue.controller import DataPartitionStatus

from knitkit.admission import AdmissionController, SourceQuota, policy_config
from knitkit.integration.ray import start_ray
from knitkit.integration.transferqueue import AdmissionSampler, sampler_conf, trajectory_tags
from knitkit.types import TrajectoryMeta

SOURCES = ("math", "code", "chart", "ocr")
TRAIN_BATCH, MINIBATCHES, GROUP, SEQ, DP = 16, 4, 2, 8, 2


def _config():
    quotas = [SourceQuota(source=s, min_ratio=0.25) for s in SOURCES]
    return policy_config(
        "knittrans",
        train_batch_size=TRAIN_BATCH,
        num_minibatches=MINIBATCHES,
        sources=SOURCES,
        quotas=quotas,
        group_size=GROUP,
    )


def test_trace_breaks_quotas_without_guards() -> None:
    """The trace below is demanding: streaming admission (no quotas) gives "ocr" too few slots."""
    controller = AdmissionController(
        policy_config(
            "streaming",
            train_batch_size=TRAIN_BATCH,
            num_minibatches=MINIBATCHES,
            sources=SOURCES,
            group_size=GROUP,
        )
    )
    first_train_batch: Counter[str] = Counter()
    for meta in _trace():
        controller.report(meta)
        while (minibatch := controller.next_minibatch()) is not None:
            if minibatch.train_batch == 0:
                first_train_batch.update(t.source for t in minibatch.trajectories)
    assert first_train_batch["ocr"] < TRAIN_BATCH // 4


def _trace() -> list[TrajectoryMeta]:
    """Two rollout steps of GRPO pairs, "math" over-sampled and "ocr" completing last (slow)."""
    metas: list[TrajectoryMeta] = []
    rng = random.Random(0)
    for step in range(2):
        order = ["math"] * 4 + ["code"] * 2 + ["chart"] * 2
        rng.shuffle(order)
        order += ["ocr", "ocr"]
        for g, source in enumerate(order):
            sample = f"s{step}-{g}"
            for k in range(GROUP):
                metas.append(TrajectoryMeta(f"{sample}/{k}", sample, source, step, SEQ, step, step))
    return metas


@pytest.fixture(scope="module")
def transfer_queue() -> Iterator[DictConfig]:
    """A real TransferQueue (controller + one SimpleStorage unit) on a fresh 2-CPU local Ray."""
    if ray.is_initialized():
        ray.shutdown()
    start_ray(num_cpus=2)
    conf = sampler_conf(
        AdmissionSampler(_config(), dp_size=DP),
        backend={"SimpleStorage": {"num_data_storage_units": 1}},
    )
    yield tq.init(conf)
    tq.close()
    ray.shutdown()


def _put(metas: list[TrajectoryMeta], partition: str = "train") -> None:
    tokens = torch.stack([torch.full((SEQ,), hash(m.trajectory_id) % 1000) for m in metas])
    fields = TensorDict({"tokens": tokens}, batch_size=len(metas))
    tq.kv_batch_put(
        keys=[m.trajectory_id for m in metas],
        partition_id=partition,
        fields=fields,
        tags=[trajectory_tags(m) for m in metas],
    )


def _fetch(task: str, dp_rank: int) -> list[dict]:
    """One ``get_meta`` of a DP rank of ``task`` (as ``StreamingDataset`` asks), as the samples' tags."""
    meta = tq.get_client().get_meta(
        data_fields=["tokens"],
        batch_size=1,
        partition_id="train",
        mode="fetch",
        task_name=task,
        sampling_config={"task_name": task, "dp_rank": dp_rank},
    )
    return list(meta.custom_meta)


def _fetch_all(task: str) -> list[list[list[dict]]]:
    """Every mini-batch admitted so far for ``task``, as its DP ranks' shares."""
    batches = []
    while True:
        shares = [_fetch(task, rank) for rank in range(DP)]
        if not shares[0]:
            assert not any(shares), "a DP rank got a share of a mini-batch its peer did not"
            return batches
        batches.append(shares)


@pytest.mark.slow
def test_get_meta_returns_admitted_minibatches_in_order(transfer_queue: DictConfig) -> None:
    """Streamed puts + per-DP-rank get_meta yield the in-process controller's mini-batches.

    Every train batch meets each source's quota, each DP rank gets whole GRPO groups (as many as
    its peer), no trajectory is handed out twice, and a second task gets the same shares in order.
    """
    trace = _trace()
    reference = AdmissionController(_config())
    expected: list[set[str]] = []
    got: list[list[list[dict]]] = []
    for start in range(0, len(trace), 6):
        chunk = trace[start : start + 6]
        _put(chunk)
        for meta in chunk:
            reference.report(meta)
        while (minibatch := reference.next_minibatch()) is not None:
            expected.append({t.trajectory_id for t in minibatch.trajectories})
        got.extend(_fetch_all("actor"))
    assert [{tags["trajectory_id"] for share in b for tags in share} for b in got] == expected
    assert len(got) > 2 * MINIBATCHES
    ids = [tags["trajectory_id"] for b in got for share in b for tags in share]
    assert len(ids) == len(set(ids))
    for shares in got:
        assert [len(share) for share in shares] == [len(shares[0])] * DP
        for rank, share in enumerate(shares):
            assert {tags["knitkit_dp_rank"] for tags in share} == {rank}
            assert set(Counter(tags["sample_id"] for tags in share).values()) == {GROUP}
    flat = [[tags for share in b for tags in share] for b in got]
    for train_batch in range(2):
        batches = [b for b in flat if b[0]["knitkit_train_batch"] == train_batch]
        assert [b[0]["knitkit_minibatch"] for b in batches] == list(range(MINIBATCHES))
        per_source = Counter(tags["source"] for b in batches for tags in b)
        assert all(per_source[s] >= TRAIN_BATCH // 4 for s in SOURCES), per_source
    assert _fetch_all("ref") == got
    first = [tags["trajectory_id"] for tags in got[0][0]]
    data = tq.kv_batch_get(keys=first, partition_id="train", select_fields="tokens")
    assert data["tokens"].shape[0] == len(first)


@pytest.mark.slow
def test_streaming_dataloader_receives_admitted_shares(transfer_queue: DictConfig) -> None:
    """TransferQueue's own StreamingDataLoader, unchanged, yields each DP rank's admitted shares."""
    trace = _trace()
    _put(trace, partition="stream")
    reference = AdmissionController(_config())
    for meta in trace:
        reference.report(meta)
    expected = []
    while (minibatch := reference.next_minibatch()) is not None:
        expected.append({t.trajectory_id for t in minibatch.trajectories})
    per_rank = []
    for rank in range(DP):
        dataset = StreamingDataset(
            transfer_queue,
            batch_size=1,
            micro_batch_size=GROUP,
            data_fields=["tokens"],
            partition_id="stream",
            task_name="trainer",
            dp_rank=rank,
        )
        loader = iter(StreamingDataLoader(dataset, num_workers=0))
        micro_batches = [next(loader) for _ in range(len(expected))]  # one GRPO group per share
        per_rank.append(
            [[tags["trajectory_id"] for tags in meta.custom_meta] for _, meta in micro_batches]
        )
        for data, meta in micro_batches:
            assert data["tokens"].shape[0] == meta.size == GROUP
    got = [set(per_rank[0][t]) | set(per_rank[1][t]) for t in range(len(expected))]
    assert got == expected


def test_untagged_samples_wait_and_partial_tags_fail() -> None:
    """A ready sample without tags is not reported until tagged; incomplete tags name what is missing."""
    partition = DataPartitionStatus("p")
    sampler = AdmissionSampler(
        policy_config("streaming", train_batch_size=2, num_minibatches=1, sources=("a",))
    )
    assert sampler.sample([0, 1], 1, partition=partition) == ([], [])
    metas = [TrajectoryMeta(f"t{i}", f"s{i}", "a", 0, 4, 0, 0) for i in range(2)]
    partition.set_custom_meta({0: trajectory_tags(metas[0])})
    assert sampler.sample([0, 1], 1, partition=partition) == ([], [])
    partition.set_custom_meta({1: trajectory_tags(metas[1])})
    assert sampler.sample([0, 1], 1, partition=partition) == ([0, 1], [0, 1])
    assert partition.get_custom_meta([0])[0]["knitkit_minibatch"] == 0
    partition.set_custom_meta({2: {"source": "a"}})
    with pytest.raises(ValueError, match="without"):
        sampler.sample([2], 1, partition=partition)
    with pytest.raises(ValueError, match="partition"):
        sampler.sample([0], 1)


def test_dp_shares_are_balanced_and_cached_for_late_ranks() -> None:
    """DP ranks get token-balanced whole groups; a rank whose share waits is served whatever is ready."""
    partition = DataPartitionStatus("p")
    config = policy_config(
        "streaming", train_batch_size=8, num_minibatches=1, sources=("a",), group_size=2
    )
    with pytest.raises(ValueError, match="dp_size=3"):
        AdmissionSampler(config, dp_size=3)
    sampler = AdmissionSampler(config, dp_size=2)
    lengths = [100, 100, 10, 10, 60, 60, 50, 50]  # group token sums 200, 20, 120, 100
    metas = [TrajectoryMeta(f"t{i}", f"s{i // 2}", "a", 0, n, 0, 0) for i, n in enumerate(lengths)]
    partition.set_custom_meta({i: trajectory_tags(m) for i, m in enumerate(metas)})
    config_of = {"task_name": "actor", "dp_rank": 1}
    assert not sampler.has_cached_result("p", "actor", config_of)
    rank0, _ = sampler.sample(list(range(8)), 1, task_name="actor", dp_rank=0, partition=partition)
    assert sampler.has_cached_result("p", "actor", config_of)
    rank1, _ = sampler.sample([], 1, task_name="actor", dp_rank=1, partition=partition)
    assert rank1 == [] and sampler.has_cached_result("p", "actor", config_of)
    rank1, _ = sampler.sample(list(range(8)), 1, task_name="actor", dp_rank=1, partition=partition)
    assert sorted(rank0 + rank1) == list(range(8)) and len(rank0) == len(rank1) == 4
    tokens = [sum(lengths[i] for i in share) for share in (rank0, rank1)]
    assert sorted(tokens) == [220, 220]
    assert not sampler.has_cached_result("p", "actor", config_of)
    with pytest.raises(ValueError, match="dp_rank=2"):
        sampler.sample([0], 1, dp_rank=2, partition=partition)


def test_groups_of_different_sources_with_one_sample_id_stay_apart() -> None:
    """Datasets number prompts independently: ("a", "17") and ("b", "17") are two GRPO groups, each
    kept whole on one DP rank (as admission keys them), never merged into one."""
    partition = DataPartitionStatus("p")
    config = policy_config(
        "streaming", train_batch_size=4, num_minibatches=1, sources=("a", "b"), group_size=2
    )
    sampler = AdmissionSampler(config, dp_size=2)
    metas = [TrajectoryMeta(f"{s}{i}", "17", s, 0, 10, 0, 0) for s in "ab" for i in range(2)]
    partition.set_custom_meta({i: trajectory_tags(m) for i, m in enumerate(metas)})
    rank0, _ = sampler.sample(list(range(4)), 1, task_name="actor", dp_rank=0, partition=partition)
    rank1, _ = sampler.sample(list(range(4)), 1, task_name="actor", dp_rank=1, partition=partition)
    shares = sorted(sorted(metas[i].source for i in share) for share in (rank0, rank1))
    assert shares == [["a", "a"], ["b", "b"]]
