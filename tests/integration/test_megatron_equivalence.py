"""A user's own Megatron VLM checked through knitkit's pytest fixture and its command, on CPU (gloo).

The model, its forward step and its data live in a package this test writes into ``tmp_path``
(``ext_vlm``): knitkit never imports it, and it reaches the ranks only through the import paths
and the ``python_path`` folder the user names, as a user's own package would. The pytest fixture
is exercised as a user sets it up (a fresh pytest session in ``tmp_path`` whose ``conftest.py``
is the one line ``pytest_plugins = [...]``), at TP2 and DP2 x TP2; the command runs under torchrun
(gloo) at TP2 and DP2 x TP2 and writes its JSON report. A deliberately broken wrap (the wrap's
encoder runs the projector with its weight detached, so the deferred backward never reaches it)
fails the check, naming that parameter.

Tolerances: the check's fp32 defaults, ``max|g - g_ref| <= 1e-4 * max(max|g_ref|, 1e-6)``, with
every reference gradient above the floor.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MODEL = '''
"""A user's Megatron VLM that knitkit never imports: GPTModel fed image features as decoder_input."""

import functools

import torch

HIDDEN, PATCH, VOCAB, IMAGE_TOKEN, MAX_SEQ = 32, 10, 48, 7, 256


class Vision(torch.nn.Module):
    """Patch embedding and projector; the rows of one image see each other."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(PATCH, 16)
        self.projector = torch.nn.Linear(16, HIDDEN)

    def encode(self, patches, projector_weight=None):
        hidden = torch.tanh(self.embed(patches))
        hidden = hidden * torch.sigmoid(hidden.mean(0, keepdim=True))
        weight = self.projector.weight if projector_weight is None else projector_weight
        return torch.nn.functional.linear(hidden, weight, self.projector.bias)

    def forward(self, images):
        return torch.cat([self.encode(patches)[a:b] for patches, a, b in images])


def provider():
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import MegatronModule, TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )

    class UserVLM(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder
            self.vision = Vision()
            self.lm = GPTModel(
                config, get_gpt_layer_local_spec(), VOCAB, MAX_SEQ, position_embedding_type="rope"
            )

        def set_input_tensor(self, tensor):
            self.lm.set_input_tensor(tensor)

        def forward(self, tokens, position_ids, attention_mask, labels, images=None):
            embeddings = self.lm.embedding(input_ids=tokens, position_ids=position_ids)
            features = self.vision(images)
            at_image = (tokens == IMAGE_TOKEN).t().unsqueeze(-1).expand_as(embeddings)
            embeddings = embeddings.masked_scatter(at_image, features.to(embeddings.dtype))
            return self.lm(
                tokens, position_ids, attention_mask, decoder_input=embeddings, labels=labels
            )

    model = UserVLM()
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=True), model
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp


def _loss(loss_mask, output):
    loss = (output.float() * loss_mask).sum()
    return loss, loss_mask.sum().to(torch.int), {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        batch["labels"],
        images=batch.get("images"),
    )
    return output, functools.partial(_loss, batch["loss_mask"])


def with_images(micro_batches, batches, load):
    """The unwrapped model's own batches: the image pieces each micro-batch consumes."""
    from knitkit.encoder_dedup import feature_slices

    for batch, plan in zip(batches, micro_batches):
        yield dict(batch, images=[(load(s.key), s.start, s.stop) for s in feature_slices(plan)])


def detached_projector(model):
    """A BROKEN wrap: its encoder runs the projector with the weight cut off from autograd."""
    vision = model.module.vision
    return lambda patches: vision.encode(patches, projector_weight=vision.projector.weight.detach())
'''

DATA = '''
"""The user's mini-batch: GRPO groups of 4 rollouts sharing their prompt's 1-2 images."""

import numpy as np

from ext_vlm.model import IMAGE_TOKEN, PATCH, VOCAB
from knitkit.storage import MultimodalInput, Trajectory


def trajectories(seed=0, prompts=3, n=4):
    rng = np.random.default_rng(seed)
    out = []
    for p in range(prompts):
        images, at = [], 1
        for _ in range(1 + p % 2):
            rows = int(rng.integers(3, 6))
            images.append(MultimodalInput("image", rng.standard_normal((rows, PATCH)).astype(np.float32), at, rows))
            at += rows + 2
        for r in range(n):
            tokens = rng.integers(8, VOCAB, size=at + int(rng.integers(6, 16))).astype(np.int64)
            for image in images:
                tokens[image.token_start : image.token_start + image.num_tokens] = IMAGE_TOKEN
            out.append(Trajectory(f"p{p}-r{r}", f"p{p}", {"tokens": tokens}, multimodal=tuple(images)))
    return out
'''

CONFTEST = 'pytest_plugins = ["knitkit.integration.megatron.testing.pytest_plugin"]\n'

USER_TESTS = """
import json
import os

from knitkit.integration.megatron.testing import VLMUnderTest

PATH = (os.environ["EXT_VLM_PATH"],)
OUT = os.environ["EXT_VLM_OUT"]
SUBJECT = VLMUnderTest(provider="ext_vlm.model:provider", forward_step="ext_vlm.model:forward_step")
BROKEN = VLMUnderTest(
    provider="ext_vlm.model:provider",
    forward_step="ext_vlm.model:forward_step",
    encoder="ext_vlm.model:detached_projector",
    reference_batches="ext_vlm.model:with_images",
)


def _save(name, report):
    print(report.table())
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump(report.to_json(), f)


def test_tp2(megatron_equivalence):
    report = megatron_equivalence.check(
        SUBJECT, "ext_vlm.data:trajectories", tensor_parallel=2, python_path=PATH
    )
    _save("fixture_tp2", report)


def test_dp2_tp2(megatron_equivalence):
    report = megatron_equivalence.check(
        SUBJECT, "ext_vlm.data:trajectories", world_size=4, tensor_parallel=2, python_path=PATH
    )
    _save("fixture_dp2_tp2", report)


def test_broken_wrap(megatron_equivalence):
    megatron_equivalence.check(BROKEN, "ext_vlm.data:trajectories", tensor_parallel=2, python_path=PATH)
"""


@pytest.fixture(scope="module")
def user_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ext_vlm`` (model, forward step, data) in a folder no knitkit code or sys.path names."""
    root = tmp_path_factory.mktemp("user_code")
    package = root / "ext_vlm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(textwrap.dedent(MODEL))
    (package / "data.py").write_text(textwrap.dedent(DATA))
    return root


def _env(**extra: str) -> dict[str, str]:
    """The caller's environment (ext_vlm is on no path in it: the ranks get it via python_path)."""
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
def test_fixture_checks_a_model_defined_outside_knitkit(user_package: Path, tmp_path: Path) -> None:
    """The one-line conftest plugin: the user's model passes at TP2 and DP2 x TP2; the broken wrap
    fails its test with the per-parameter table, naming the detached projector weight."""
    tests = tmp_path / "user_tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(CONFTEST)
    (tests / "test_user_model.py").write_text(textwrap.dedent(USER_TESTS))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(tests)],
        cwd=tmp_path,
        env=_env(EXT_VLM_PATH=str(user_package), EXT_VLM_OUT=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = run.stdout
    assert "1 failed, 2 passed" in out, out[-6000:] + run.stderr[-3000:]
    for name in ("fixture_tp2", "fixture_dp2_tp2"):
        _assert_equivalent(json.loads((tmp_path / f"{name}.json").read_text()))
    failure = out[out.index("test_broken_wrap") :]
    assert "NOT equivalent" in failure and "failing (1): vision.projector.weight" in failure, (
        failure[-4000:]
    )
    row = re.search(r"vision\.projector\.weight +(\S+) +(\S+) +(\S+) +\d+ +mismatch", failure)
    assert row and float(row.group(3)) == 1.0, failure[-4000:]  # its gradient never arrived


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "label"), [(2, "tp2"), (4, "dp2_tp2")])
def test_command_checks_a_model_defined_outside_knitkit(
    user_package: Path, tmp_path: Path, nproc: int, label: str
) -> None:
    """``knitkit check-equivalence`` under torchrun (gloo): prints the table, writes the JSON
    report, exits 0 for the user's model at TP2 (2 ranks) and DP2 x TP2 (4 ranks)."""
    report_path = tmp_path / f"command_{label}.json"
    run = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *(f"--nproc-per-node={nproc}", "-m", "knitkit", "check-equivalence"),
            *("--provider", "ext_vlm.model:provider"),
            *("--forward-step", "ext_vlm.model:forward_step"),
            *("--trajectories", "ext_vlm.data:trajectories"),
            *("--tp", "2", "--python-path", str(user_package), "--json", str(report_path)),
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "PASS" in run.stdout and "vision.projector.weight" in run.stdout, out[-6000:]
    report = json.loads(report_path.read_text())
    _assert_equivalent(report)
    assert f"DP{nproc // 2} x CP1 x TP2" in report["title"]


@pytest.mark.slow
def test_command_fails_a_broken_wrap_naming_the_parameter(
    user_package: Path, tmp_path: Path
) -> None:
    """Without torchrun the command spawns its ranks (``--nproc``); the broken wrap exits 1 with the
    projector weight's row marked ``mismatch`` in the table and in the JSON report."""
    report_path = tmp_path / "broken.json"
    run = subprocess.run(
        [
            *(sys.executable, "-m", "knitkit", "check-equivalence", "--nproc", "2", "--tp", "2"),
            *("--provider", "ext_vlm.model:provider"),
            *("--forward-step", "ext_vlm.model:forward_step"),
            *("--trajectories", "ext_vlm.data:trajectories"),
            *("--encoder", "ext_vlm.model:detached_projector"),
            *("--reference-batches", "ext_vlm.model:with_images"),
            *("--python-path", str(user_package), "--json", str(report_path)),
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-4000:]
    assert re.search(r"vision\.projector\.weight .* mismatch", run.stdout), run.stdout[-4000:]
    report = json.loads(report_path.read_text())
    assert not report["ok"]
    assert [r["name"] for r in report["gradients"] if r["status"] == "mismatch"] == [
        "vision.projector.weight"
    ]
