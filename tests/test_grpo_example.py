"""The GRPO example trains exactly as the same loop without knitkit, and its rollout stand-in is keyed and resumable."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from example_checks import GRPO_STEPS, GrpoRun, check_output

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from grpo import compare, plain  # noqa: E402
from grpo.clock import StepClock  # noqa: E402
from grpo.rewards import group_advantages  # noqa: E402
from grpo.rollout import RolloutConfig, RolloutStandIn, generate_group  # noqa: E402

from knitkit.integration.sglang import PayloadConfig, RolloutWriter  # noqa: E402
from knitkit.storage import MemoryBackend, TrajectoryStore  # noqa: E402


def test_knitkit_loop_equals_plain_loop(grpo_reference_run: GrpoRun) -> None:
    """Over 2 GRPO steps on DP2 x TP2 (gloo, 4 torchrun ranks), the example's knitkit path
    (driver, reorganizers, per-rank handles, passes with write-back, encoder dedup), run as its
    docstring's ``Run:`` line says (its printed lines and TensorBoard figures checked), and the plain
    loop on the same admitted trajectories (per-rank loading, no dedup, log-probs recomputed per
    pass) agree: per-step figures, every gradient element of every step, and every parameter's
    update after the last step, each within its stated fp32 tolerance (``grpo.compare``:
    FIGURES, GRADIENTS, PARAMETERS), checked relatively where the reference is above the floor.
    Each mini-batch is trained ``ppo_epochs`` (2) times on its old log-probs, so the ratio leaves 1
    and PPO's clip binds (the first step clips a tenth of the tokens, the same in both loops);
    the example prints no warning around its result lines. The run (``grpo_reference_run``, in
    conftest.py) is also the kill/resume test's uninterrupted run.
    """
    done = grpo_reference_run
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    example = ROOT / "examples" / "grpo_megatron.py"
    check_output(
        example, done.stdout, done.stderr, done.workdir / "tb"
    )  # test_examples.py leaves it to this run
    report = json.loads((done.workdir / "grpo.json").read_text())
    result = report["comparison"]
    assert result["same_trajectories"], "the plain loop trained other trajectories"
    assert len(report["knitkit"]) == len(report["plain"]) == GRPO_STEPS
    for name, tolerance in (
        ("figures", compare.FIGURES),
        ("gradients", compare.GRADIENTS),
        ("parameters", compare.PARAMETERS),
    ):
        check = result[name]
        assert check["tolerance"] == {
            "rtol": tolerance.rtol,
            "atol": tolerance.atol,
            "floor": tolerance.floor,
        }
        assert check["max_abs"] <= tolerance.atol, (name, check)
        assert check["max_rel"] <= tolerance.rtol, (name, check)
        assert check["ok"], (name, check, done.stdout)
    # The comparison has teeth: thousands of values above the floor, a reference that trained.
    assert result["gradients"]["checked"] > 10_000 and result["parameters"]["checked"] > 10_000
    assert result["parameters"]["reference_max"] > 100 * compare.PARAMETERS.atol
    for mine, ref in zip(report["knitkit"], report["plain"], strict=True):
        assert mine["trajectory_ids"] == ref["trajectory_ids"]
        assert len(mine["trajectory_ids"]) == 16
        assert mine["figures"]["sequences"] == pytest.approx(1.0, abs=1e-5)
        # 2 prompts per mini-batch: each image encoded once per pass with dedup; without it,
        # once per trajectory on each of the 2 TP ranks.
        assert mine["figures"]["images_encoded"] == 2
        assert ref["figures"]["images_encoded"] == 32
    assert report["knitkit"][-1]["figures"]["kl"] > 1e-3, "the policy never left the reference"
    # Several optimizer steps per mini-batch: the ratio moves and the clip binds, in both loops.
    clipped = [step["figures"]["clipped"] for step in report["knitkit"]]
    assert clipped[0] > 0.05, f"PPO's clip never bound: clipped fractions {clipped}"
    assert all(abs(step["figures"]["pg"]) > 1e-3 for step in report["knitkit"]), "ratio stayed 1"
    assert result["ok"]


def test_rollout_groups_are_keyed_and_resumable() -> None:
    """A group is a pure function of (seed, step, prompt): regenerated alike, and a stand-in
    restored from a state dict hands back exactly the groups the original would have."""
    config = RolloutConfig()
    first = RolloutStandIn(config)
    list(first.groups(3))
    state = json.loads(json.dumps(first.state_dict()))
    expected = [g.sample_id for g in first.groups(5)]
    resumed = RolloutStandIn(config)
    resumed.load_state_dict(state)
    assert [g.sample_id for g in resumed.groups(5)] == expected
    a, b = generate_group(config, 1, 2), generate_group(config, 1, 2)
    assert a.outputs == b.outputs and a.rewards == b.rewards
    assert np.array_equal(a.requests[0].images[0], b.requests[0].images[0])
    assert generate_group(config, 1, 3).outputs != a.outputs


def test_group_advantages_are_normalised() -> None:
    """GRPO's advantages have mean 0 and unit (unbiased) std within a group; equal rewards give 0."""
    advantages = np.asarray(group_advantages([0.1, 0.5, 0.9, 0.3]))
    assert advantages.mean() == pytest.approx(0.0, abs=1e-12)
    assert advantages.std(ddof=1) == pytest.approx(1.0, rel=1e-5)
    assert group_advantages([0.4] * 8) == (0.0,) * 8


def test_plain_loader_matches_the_sglang_adapter() -> None:
    """The plain loop's own loading (plain numpy from the /generate output) yields the tokens,
    next-token labels and loss mask the SGLang adapter stores, and the same image."""
    config = RolloutConfig()
    group = generate_group(config, 0, 1)
    store = TrajectoryStore(MemoryBackend())
    writer = RolloutWriter(store, PayloadConfig(image_token_id=config.image_token))
    for request, output in zip(group.requests, group.outputs, strict=True):
        writer.add(request, output)
        stored = store.read_trajectory(request.trajectory_id)
        mine = plain.load(config, request.trajectory_id)
        assert np.array_equal(stored["tokens"], mine.tokens)
        assert np.array_equal(stored["labels"], mine.labels)
        assert np.array_equal(stored["loss_mask"], mine.loss_mask)
        (key,) = store.meta(request.trajectory_id).multimodal
        assert np.array_equal(store.read(key.key), mine.image)


def test_the_step_clock_counts_a_passs_first_micro_batch_on_its_own() -> None:
    """``StepClock.timed(first=...)``: the wait for a pass's first micro-batch (the one that
    waits for what an earlier pass wrote back) is its own kind, every later one's is ``batch``,
    and the step's data wait is their sum; a pass with no micro-batch counts its one look."""
    clock = StepClock()
    clock.start()
    assert list(clock.timed(iter([1, 2, 3]), first="first_batch")) == [1, 2, 3]
    assert list(clock.timed(iter([]), first="first_batch")) == []
    figures = clock.stop()
    assert set(clock.waits) == {"first_batch", "batch"}
    parts = figures["data_wait_s.first_batch"] + figures["data_wait_s.batch"]
    assert figures["data_wait_s"] == pytest.approx(parts)
