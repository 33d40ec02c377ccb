"""Prove the dedup wrap on your own Megatron VLM: same gradients as unwrapped, on your parallel layout.

Three ways in, one check underneath (``check_equivalence``, run on every rank):

- in your own distributed code: ``check_equivalence(VLMUnderTest(provider=..., forward_step=...),
  trajectories).raise_if_failed()`` after ``parallel_state.initialize_model_parallel``;
- in pytest: ``pytest_plugins = ["knitkit.integration.megatron.testing.pytest_plugin"]`` in
  ``conftest.py``, then ``megatron_equivalence.check(subject, "my_pkg.data:trajectories",
  tensor_parallel=2)`` spawns the ranks (gloo on CPU, NCCL on GPUs);
- from a shell: ``torchrun --nproc-per-node N -m knitkit check-equivalence --provider ...``.

The report (``EquivalenceReport``) holds per parameter max|g - g_ref|, max|g_ref|, the relative
error and the rank holding the worst; losses and log-probs; units encoded with and without dedup.
"""

from knitkit.encoder_dedup import Comparison, EquivalenceError, EquivalenceReport, Tolerance
from knitkit.integration.megatron.testing.check import Trajectories, check_equivalence
from knitkit.integration.megatron.testing.contract import ContractError
from knitkit.integration.megatron.testing.job import CheckJob, run_job
from knitkit.integration.megatron.testing.reference import with_images
from knitkit.integration.megatron.testing.subject import ReferenceBatches, VLMUnderTest
from knitkit.integration.megatron.testing.world import WorkerError, World, run_world

__all__ = [
    "CheckJob",
    "Comparison",
    "ContractError",
    "EquivalenceError",
    "EquivalenceReport",
    "ReferenceBatches",
    "Tolerance",
    "Trajectories",
    "VLMUnderTest",
    "WorkerError",
    "World",
    "check_equivalence",
    "run_job",
    "run_world",
    "with_images",
]
