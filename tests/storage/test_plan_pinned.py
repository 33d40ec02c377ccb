"""The planner's output is pinned: fixed seeded workloads give exactly the plans (and balancing /
packing / CP results) the straightforward planner of commit bd02435 gave, so speeding it up can
change no assignment, micro-batch or order."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from knitkit.storage import EncoderTopology, MiniBatchPlan, PlannerConfig, Topology, plan_minibatch
from knitkit.storage.baselines.synthetic import synthetic_metas
from knitkit.storage.planning.balance import karmarkar_karp, pack_ranks_by_budget
from knitkit.storage.planning.cp import rank_chunks
from knitkit.types import MultimodalRef, TrajectoryMeta, UnitKey

Workload = tuple[list[TrajectoryMeta], Topology, PlannerConfig, tuple[EncoderTopology, ...]]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plan_digest(plan: MiniBatchPlan) -> str:
    """The plan's canonical form (its dataclass repr: every field of every value, in order, tuples
    told from lists), hashed."""
    return _digest(repr(plan))


def _random_workload(seed: int) -> Workload:
    """A small mini-batch with everything the planner branches on: GRPO groups (interleaved or
    not), rejected trajectories, empty ones, shared and unshared images and videos with and
    without costs, more DP ranks than groups (idle ranks), CP > 1, sequence parallelism, FP8
    padding, budgets or none, one or two encoders."""
    rng = np.random.default_rng(seed)
    group = int(rng.integers(1, 9))
    count = int(rng.integers(0, 90))
    shared = int(rng.integers(1, 12))
    metas = []
    for i in range(count):
        n = int(rng.integers(0, 3000)) if rng.random() < 0.95 else 0
        refs = []
        for _ in range(int(rng.integers(0, 3))):
            start = int(rng.integers(0, n + 1))
            length = int(rng.integers(0, n - start + 1))
            kind = "image" if rng.random() < 0.7 else "video"
            owner = f"h{int(rng.integers(0, shared))}" if rng.random() < 0.6 else f"u{seed}-{i}"
            cost = float(rng.choice([0.0, 3.0, 7.5, float(rng.integers(1, 50))]))
            refs.append(MultimodalRef(UnitKey(owner, kind), start, length, cost))
        metas.append(
            TrajectoryMeta(
                trajectory_id=f"t{i}",
                sample_id=f"s{i // group}",
                source="a",
                rollout_step=0,
                num_tokens=n,
                min_version=0,
                max_version=0,
                accepted=bool(rng.random() < 0.9),
                multimodal=tuple(refs),
            )
        )
    if rng.random() < 0.5:
        metas = [metas[j] for j in rng.permutation(len(metas))]
    topology = Topology(
        dp=int(rng.integers(1, 40)),
        cp=int(rng.integers(1, 5)),
        tp=int(rng.integers(1, 5)),
        sequence_parallel=bool(rng.random() < 0.5),
    )
    budget = None if rng.random() < 0.3 else int(rng.integers(64, 6000))
    encoder_budget = None if rng.random() < 0.5 else float(rng.uniform(1.0, 120.0))
    config = PlannerConfig(
        max_tokens_per_micro_batch=budget,
        min_micro_batches=int(rng.integers(1, 5)),
        keep_groups=bool(rng.random() < 0.5),
        encoder_max_cost_per_micro_batch=encoder_budget,
        pad_multiple=int(rng.choice([1, 1, 16])),
    )
    encoders = (EncoderTopology("vision", dp=int(rng.integers(1, 9))),)
    if rng.random() < 0.5:
        encoders += (EncoderTopology("video", dp=int(rng.integers(1, 4)), kinds=("video",)),)
    return metas, topology, config, encoders


def _contract(num_trajectories: int, dp: int, keep_groups: bool) -> Workload:
    """The planner_ms workloads (benchmarks/README.md): GRPO groups of 8, 64k-token micro-batches, DP8 encoder
    (without groups: at least 20 micro-batches, more than the budget needs)."""
    config = PlannerConfig(
        max_tokens_per_micro_batch=65536,
        keep_groups=keep_groups,
        min_micro_batches=1 if keep_groups else 20,
    )
    return (
        synthetic_metas(num_trajectories, group_size=8, seed=1),
        Topology(dp=dp, cp=2, tp=4),
        config,
        (EncoderTopology("vision", dp=8),),
    )


PINNED_RANDOM = {
    0: "771f4b724fb65d9b",
    1: "460b5a42e62b0c05",
    2: "68d610ae02d15b04",
    3: "fc86b2c760c578db",
    4: "7d6a651497e26caa",
    5: "c6399f9df267b103",
    6: "d2db5354d48eed72",
    7: "19999a20d1973bb9",
    8: "556736fc06db05e4",
    9: "4c1e053c78654b65",
    10: "a8dd3e8220423b61",
    11: "0bfc52a5959a17b6",
    12: "7db0a121b68685da",
    13: "64c8e7318ab7fd08",
    14: "9e4e3e9105b05ff8",
    15: "1c626edd264c0495",
    16: "d2c2cd807609ef95",
    17: "fc514fbad2965c1d",
    18: "28a6c7c015828327",
    19: "136cf523078b1d38",
    20: "35e92cdb2872b938",
    21: "d1a8f008641e4115",
    22: "6ed11d17d7a974db",
    23: "3165c92fd49b500f",
    24: "0a778cb7a21137cc",
    25: "c6b91d25e00ff5ba",
    26: "02cc6b236d22faa4",
    27: "ae7dc99f2bdc24ea",
    28: "fec4b5ad28420460",
    29: "6e053e206bfaa5e7",
    30: "99f1b68060eec6f9",
    31: "b19bd52ebf662faf",
    32: "08572c3cd9e16022",
    33: "e7f5ca2dacaad991",
    34: "9df270c48bdac20b",
    35: "ac45bd884e6f5573",
    36: "ed2b8a3d79356de5",
    37: "cebd7d0dea9bce0c",
    38: "aba016c55d206f33",
    39: "12c5c379aebf6cbb",
    40: "74e219eb77aec1d8",
    41: "fd22abda07547ab1",
    42: "cee7b8ac2828972b",
    43: "a843569c8eda42a5",
    44: "30b370ee18377901",
    45: "f801888ad8d63416",
    46: "3fffbdfe0ebe356d",
    47: "31e3cc9f28bc231b",
    48: "594775a33a41a2a5",
    49: "f74412cd03e07b18",
    50: "a0dc8889a0f34346",
    51: "ddcb742c933de965",
    52: "315447617cf12810",
    53: "b0cfd6330825bca8",
    54: "877d0e172a5b371f",
    55: "89f6a4860a7fb458",
    56: "f9758b44eeac73ff",
    57: "f1141123fd287b72",
    58: "db3efa83f7defb33",
    59: "813493509ce93d92",
}
"""``_plan_digest`` of ``_random_workload(seed)``'s plan, computed with the bd02435 planner."""


def test_random_workloads_plan_exactly_as_pinned() -> None:
    """Every seeded small workload (all planner branches) gives byte-for-byte the pinned plan."""
    got = {}
    for seed in PINNED_RANDOM:
        metas, topology, config, encoders = _random_workload(seed)
        got[seed] = _plan_digest(plan_minibatch(metas, topology, config, encoders, f"mb{seed}"))
    assert got == PINNED_RANDOM


PINNED_CONTRACT = {
    (4096, 32, True): "621cae04f4761251",
    (16384, 128, True): "2980f43f6d9d6e48",
    (4096, 32, False): "fb0e82233accbaeb",
    (1024, 256, True): "08c7e24f5c5f0e85",
}
"""``_plan_digest`` of the contract workloads' plans (``(trajectories, dp, keep_groups)``), from
bd02435."""


@pytest.mark.parametrize("size", list(PINNED_CONTRACT))
def test_contract_workloads_plan_exactly_as_pinned(size: tuple[int, int, bool]) -> None:
    """The benchmark's DP32 x CP2 x TP4 (4096 trajectories) and DP128 (16384) plans, with
    group-atomic placement and the encoder plan, equal the pinned ones; so do the 4096
    trajectories without groups and 1024 of them over DP256 (idle ranks)."""
    metas, topology, config, encoders = _contract(*size)
    assert (
        _plan_digest(plan_minibatch(metas, topology, config, encoders, "mb"))
        == (PINNED_CONTRACT[size])
    )


PINNED_FUNCTIONS = "66da6cafeb144c21"
"""Digest of the public balancing, packing and CP helpers' results on seeded inputs (bd02435)."""


def test_balancing_packing_and_cp_helpers_return_exactly_as_pinned() -> None:
    """``karmarkar_karp`` (both modes, with tied costs), ``pack_ranks_by_budget`` and
    ``rank_chunks`` give the pinned results on seeded inputs."""
    rng = np.random.default_rng(7)
    results: list[object] = []
    for _ in range(60):
        n = int(rng.integers(0, 200))
        costs = rng.integers(0, 20, n).astype(float).tolist()  # many ties
        if rng.random() < 0.5:
            costs = rng.uniform(0, 1e6, n).tolist()
        k = int(rng.integers(1, 20))
        results.append(karmarkar_karp(costs, k, equal_size=bool(rng.random() < 0.5)))
        ranks = int(rng.integers(1, 10))
        tokens = [rng.integers(0, 3000, int(rng.integers(0, 40))).tolist() for _ in range(ranks)]
        budget = None if rng.random() < 0.3 else int(rng.integers(100, 5000))
        results.append(pack_ranks_by_budget(tokens, budget, int(rng.integers(1, 4))))
        cp = int(rng.integers(1, 5))
        padded = rng.integers(0, 500, 30) * 2 * cp
        results.append([rank_chunks(padded, cp, r) for r in range(cp)])
    assert _digest(repr(results)) == PINNED_FUNCTIONS
