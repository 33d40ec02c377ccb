"""The clairvoyant per-batch optimum lower-bounds every quota-preserving online policy."""

from __future__ import annotations

import numpy as np
import pytest

from knitkit.admission import SourceQuota
from knitkit.admission.replay import BatchWindow, offline_optimum, online_finish
from knitkit.admission.replay.oracle import random_window


def test_small_exact_example() -> None:
    """Two sources, 2 each of a batch of 4 in two mini-batches: the oracle pairs early arrivals."""
    arrivals = ((1.0, "A"), (2.0, "A"), (3.0, "B"), (10.0, "B"), (11.0, "A"))
    quotas = (SourceQuota(source="A", min_count=2), SourceQuota(source="B", min_count=2))
    window = BatchWindow(arrivals, 4, 2, quotas, minibatch_s=1.0)
    # best: {A, A} at t=2 -> trained until 3; {B, B} at t=10 -> until 11
    assert offline_optimum(window) == pytest.approx(11.0)
    assert online_finish("knittrans", window) == pytest.approx(11.0)
    assert online_finish("barrier", window) == pytest.approx(12.0)


@pytest.mark.parametrize("seed", range(4))
def test_oracle_lower_bounds_guarded_policies(seed: int) -> None:
    """No policy that meets the quotas finishes the train batch before the offline optimum."""
    window = random_window(np.random.default_rng(seed), {"A": 1.0, "B": 3.0, "C": 9.0}, 0.25, 12, 3)
    best = offline_optimum(window)
    for policy in ("barrier", "linear", "knittrans", "adaptive"):
        assert online_finish(policy, window) >= best - 1e-9
