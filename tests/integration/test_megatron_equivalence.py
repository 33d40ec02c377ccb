"""A user's own Megatron VLM checked through knitkit's pytest fixture and its command, on CPU (gloo).

The user's model is the template ``examples/check_my_model`` (``my_vlm``: provider, forward step,
trajectories; its conftest and test): knitkit never imports it, it reaches the ranks only through
the import paths and the ``python_path`` folder the user names. One fresh pytest session runs the
template's own test as written (TP2 and DP2 x TP2) and, on the same spawned worlds, the planted
models of ``planted_vlm`` (written into ``tmp_path``): a per-image encoder that reverses an
image's rows and one that detaches the trunk before the projector fail in the default mode (the
reference is the model's own forward, NOTE [ Re-encoding reference ]); the correct model with a
separate forward-only step and explicit reference batches passes; a projector split over TP by
hand, declared replicated, ends in the report naming its parameter (NOTE [ Hand sharding shows in
the reference ]). The command runs under torchrun (gloo) at TP2 and DP2 x TP2 and writes its JSON
report; without torchrun it spawns its ranks and fails the reversing encoder; pointed at callables
that break the contract (the Megatron example's own ``build_model``) it names them and exits 2
before any rank starts.

Tolerances: the check's fp32 defaults, ``max|g - g_ref| <= 1e-4 * max(max|g_ref|, 1e-6)``, with
every reference gradient above the floor.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from processes import BOUND_S, gone, kill_left, wait_until

from knitkit.integration.megatron.testing import VLMUnderTest
from knitkit.testing import run_to_end

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples" / "check_my_model"

PLANTED = '''
"""Planted variants of the template's model: broken per-image encoders, a hand-sharded projector."""

import torch

from my_vlm.model import HIDDEN, Vision, build


def reversed_rows(model):
    """BROKEN: each image's feature rows come out in reverse order."""
    vision = model.module.vision
    return lambda patches: vision.encode(patches).flip(0)


def detached_trunk(model):
    """BROKEN: the trunk is cut off from autograd before the projector."""
    vision = model.module.vision
    return lambda patches: vision.projector(vision.trunk(patches).detach())


class HandShardedVision(Vision):
    """The projector's output columns split over TP by hand (a plain Linear, no megatron marks)."""

    def __init__(self):
        super().__init__()
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.projector = torch.nn.Linear(16, HIDDEN // tp)

    def encode(self, patches):
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(self.projector(self.trunk(patches)))


def hand_sharded():
    return build(HandShardedVision)


def _logprobs(output):
    return output.sum(), {"logprobs": -output.detach().float().reshape(-1)}


def logprob_step(data_iterator, model):
    """A separate forward step for log-prob passes."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch.get("attention_mask"), batch["labels"],
        images=batch.get("images"),
    )
    return output, _logprobs
'''

PLANTED_TESTS = """
import os

from knitkit.integration.megatron.testing import VLMUnderTest

PATH = tuple(os.environ["PLANTED_PATH"].split(os.pathsep))
VISION = {"vision.embed.weight", "vision.embed.bias", "vision.projector.weight", "vision.projector.bias"}


def _report(checker, provider="my_vlm.model:provider", forward_only=False, **fields):
    subject = VLMUnderTest(provider=provider, forward_step="my_vlm.model:forward_step", **fields)
    report = checker.report(
        subject, "my_vlm.data:trajectories", tensor_parallel=2, python_path=PATH,
        forward_only=forward_only,
    )
    print(report.table())
    return report


def test_reversed_rows_fail(megatron_equivalence):
    report = _report(megatron_equivalence, encoder="planted_vlm:reversed_rows")
    assert not report.ok and VISION <= {c.name for c in report.failures}


def test_detached_trunk_fails(megatron_equivalence):
    report = _report(megatron_equivalence, encoder="planted_vlm:detached_trunk")
    failing = {c.name for c in report.failures}
    assert not report.ok and {"vision.embed.weight", "vision.embed.bias"} <= failing


def test_forward_only_step_with_reference_batches_passes(megatron_equivalence):
    report = _report(
        megatron_equivalence,
        forward_only=True,
        forward_only_step="planted_vlm:logprob_step",
        reference_batches="knitkit.integration.megatron.testing:with_images",
    )
    report.raise_if_failed(expect_below_floor=())
    assert "forward_only[logprobs]" in {c.name for c in report.outputs}


def test_hand_sharded_projector_declared_replicated_is_named(megatron_equivalence):
    report = _report(megatron_equivalence, provider="planted_vlm:hand_sharded")
    assert not report.ok
    named = [p for p in report.problems if "split over TP by hand" in p]
    assert named and "vision.projector.weight" in named[0], report.problems
"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``planted_vlm`` in a folder no knitkit code or sys.path names."""
    root = tmp_path_factory.mktemp("planted")
    (root / "planted_vlm.py").write_text(textwrap.dedent(PLANTED))
    return root


def _env(**extra: str) -> dict[str, str]:
    """The caller's environment (my_vlm is on no path in it: the ranks get it via python_path)."""
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def _figures(report: dict[str, object]) -> str:
    rows = report["gradients"]
    assert isinstance(rows, list)
    vision = [r for r in rows if r["name"].startswith("vision.")]
    return (
        f"{len(rows)} parameters, worst relative error {report['worst_relative_error']:.2e}, "
        f"vision {[(r['name'], r['relative_error']) for r in vision]}, "
        f"units {report['units_with_dedup']} with dedup / {report['units_without_dedup']} without"
    )


def _assert_equivalent(report: dict[str, object]) -> None:
    assert report["ok"], report["problems"]
    assert report["below_floor"] == [], report["below_floor"]  # every reference above the floor
    tolerance = report["tolerance"]
    assert isinstance(tolerance, dict)
    assert report["worst_relative_error"] <= tolerance["rtol"] == 1e-4  # type: ignore[operator]
    names = {r["name"] for r in report["gradients"]}  # type: ignore[union-attr]
    assert {"vision.embed.weight", "vision.projector.weight"} <= names
    print(_figures(report))


@pytest.mark.slow
def test_template_and_planted_models_through_the_fixture(planted: Path, tmp_path: Path) -> None:
    """One pytest session, as a user runs it: the template's own test passes at TP2 and DP2 x TP2;
    on the same worlds the reversing and the trunk-detaching encoders fail in the default mode,
    a forward-only step with reference batches passes, and the hand-sharded projector declared
    replicated ends in the report naming ``vision.projector.weight`` (no abort inside gloo)."""
    tests = tmp_path / "planted_tests"
    tests.mkdir()
    (tests / "test_planted.py").write_text(textwrap.dedent(PLANTED_TESTS))
    run = run_to_end(
        [
            *(sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"),
            *(str(TEMPLATE), str(tests)),
        ],
        cwd=tmp_path,
        env=_env(PLANTED_PATH=os.pathsep.join([str(TEMPLATE), str(planted)])),
        capture_output=True,
        text=True,
        timeout_s=900,
    )
    out = run.stdout
    assert run.returncode == 0 and "6 passed" in out, out[-8000:] + run.stderr[-3000:]
    assert "PASS" in out and "worst relative gradient error" in out, out[-4000:]


@pytest.mark.slow
def test_command_checks_a_model_defined_outside_knitkit(tmp_path: Path) -> None:
    """``knitkit check-equivalence`` under torchrun (gloo): prints the table, writes the JSON
    report, exits 0 for the user's model at DP2 x TP2 (4 ranks; TP2 alone is the fixture
    test's first world, ``test_template_and_planted_models_through_the_fixture``)."""
    nproc = 4
    report_path = tmp_path / "command_dp2_tp2.json"
    run = run_to_end(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *(f"--nproc-per-node={nproc}", "-m", "knitkit", "check-equivalence"),
            *("--provider", "my_vlm.model:provider"),
            *("--forward-step", "my_vlm.model:forward_step"),
            *("--trajectories", "my_vlm.data:trajectories"),
            *("--tp", "2", "--python-path", str(TEMPLATE), "--json", str(report_path)),
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout_s=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "PASS" in run.stdout and "vision.projector.weight" in run.stdout, out[-6000:]
    report = json.loads(report_path.read_text())
    _assert_equivalent(report)
    assert f"DP{nproc // 2} x CP1 x TP2" in report["title"]


@pytest.mark.slow
def test_command_fails_a_broken_wrap_naming_the_parameter(planted: Path, tmp_path: Path) -> None:
    """Without torchrun the command spawns its ranks (``--nproc``); the encoder that reverses an
    image's rows fails in the default mode: exit 1, the vision rows marked ``mismatch`` in the table
    and in the JSON report."""
    report_path = tmp_path / "broken.json"
    run = run_to_end(
        [
            *(sys.executable, "-m", "knitkit", "check-equivalence", "--nproc", "2", "--tp", "2"),
            *("--provider", "my_vlm.model:provider"),
            *("--forward-step", "my_vlm.model:forward_step"),
            *("--trajectories", "my_vlm.data:trajectories"),
            *("--encoder", "planted_vlm:reversed_rows"),
            *("--python-path", str(TEMPLATE), str(planted), "--json", str(report_path)),
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout_s=600,
    )
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-4000:]
    assert re.search(r"vision\.projector\.weight .* mismatch", run.stdout), run.stdout[-4000:]
    report = json.loads(report_path.read_text())
    assert not report["ok"]
    mismatched = {r["name"] for r in report["gradients"] if r["status"] == "mismatch"}
    assert {"vision.embed.weight", "vision.projector.weight"} <= mismatched, mismatched


def test_command_names_callables_that_break_the_contract(tmp_path: Path) -> None:
    """Pointed at the Megatron example's own ``build_model`` and ``grpo_trajectories`` (each needs
    arguments the check does not pass), the command exits 2 before any rank starts, naming both
    callables, their flags and the missing argument."""
    run = run_to_end(
        [
            *(sys.executable, "-m", "knitkit", "check-equivalence", "--nproc", "2", "--tp", "2"),
            *("--provider", "megatron_wrap:build_model"),
            *("--forward-step", "megatron_wrap:forward_step"),
            *("--trajectories", "megatron_wrap:grpo_trajectories"),
            *("--python-path", str(ROOT / "examples")),
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout_s=120,
    )
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    err = run.stderr
    assert "provider (--provider) 'megatron_wrap:build_model'" in err, err
    assert "'overlap_grad_reduce'" in err and "trajectories (--trajectories)" in err, err
    assert "'seed'" in err and "forward_step" not in err, err
    assert "Traceback" not in err, err


STUCK = """
import os
import time
from pathlib import Path

import torch.distributed as dist


def provider():  # no argument, as the contract asks; never returns: the ranks stay busy
    (Path(os.environ["STUCK_OUT"]) / f"rank{dist.get_rank()}").write_text(str(os.getpid()))
    time.sleep(600)
"""


def test_a_sigterm_to_the_command_ends_its_ranks(tmp_path: Path) -> None:
    """NOTE [ SIGTERM while child processes are open ]: ``knitkit check-equivalence --nproc``
    stopped by SIGTERM (a scheduler, a timeout) while its ranks build the model exits 143 through
    its ``with World``, which ends them; before, it died by the signal and its ranks ran on."""
    (tmp_path / "stuck_vlm.py").write_text(STUCK)
    command = [
        *(sys.executable, "-m", "knitkit", "check-equivalence", "--nproc", "2", "--tp", "2"),
        *("--provider", "stuck_vlm:provider", "--forward-step", "my_vlm.model:forward_step"),
        *("--trajectories", "my_vlm.data:trajectories"),
        *("--python-path", str(TEMPLATE), str(tmp_path), "--json", str(tmp_path / "r.json")),
    ]
    check = subprocess.Popen(command, cwd=tmp_path, env=_env(STUCK_OUT=str(tmp_path)))
    pids: list[int] = []
    try:
        ranks = [tmp_path / f"rank{r}" for r in range(2)]
        wait_until(lambda: all(p.exists() and p.read_text() for p in ranks), "both ranks stuck")
        pids = [int(p.read_text()) for p in ranks]
        check.send_signal(signal.SIGTERM)
        assert check.wait(BOUND_S) == 128 + signal.SIGTERM
        wait_until(lambda: all(map(gone, pids)), f"ranks {pids} gone")
    finally:
        kill_left(pids)
        if check.poll() is None:
            check.kill()


def test_contract_errors_name_the_callable_and_what_it_returned() -> None:
    """Signatures and returns of the three callables: a forward step of the wrong arity, a
    provider that returns a bare module, a forward step returning a bare tensor, trajectories
    that are not ``Trajectory`` objects: each error names the callable and the fix."""
    from knitkit.integration.megatron.testing import ContractError
    from knitkit.integration.megatron.testing.contract import (
        check_contract,
        checked_model,
        checked_step,
    )

    subject = VLMUnderTest(provider=lambda: None, forward_step=lambda batch: None)
    with pytest.raises(ContractError) as error:
        check_contract(subject, [1, 2])
    text = str(error.value)
    assert "forward_step (--forward-step)" in text and "(data_iterator, model)" in text, text
    assert "item 0 is an int, not a knitkit.storage.Trajectory" in text, text
    assert "provider" not in text.split("forward_step")[0], text  # the provider's signature is fine
    with pytest.raises(ContractError, match=r"returned a Linear; it must return .*Distributed"):
        checked_model("my_pkg:provider", torch.nn.Linear(1, 1))
    step = checked_step("forward_step", lambda data_iterator, model: torch.zeros(1))
    with pytest.raises(ContractError, match=r"forward_step .* returned a Tensor; .*loss_func"):
        step(iter([]), None)
