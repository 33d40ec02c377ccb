"""A job whose ranks run on other nodes than its driver, each node with its own /dev/shm: the
driver's schedule and the write-backs cross nodes through Ray (``RayControl``) and the job
gives what the same job gives on one node (issue 32, item 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from knitkit.testing import SimulatedCluster, unavailable_reason

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "job"))

from job_harness import join, run_ranks, token_ids  # noqa: E402
from job_node import JOB, controller, figures, job_config, job_coords, job_data, seen_json  # noqa: E402

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
SCRIPT = str(HERE / "job_node.py")
RANKS_PER_NODE = 2


def _one_node() -> tuple[list[dict[str, object]], dict[str, float]]:
    """``JOB`` on this node: local rings, reorganizer processes, ranks in threads."""
    data = job_data()
    with job_config().build(admission=controller(data, JOB["minibatches"])) as driver:
        threads, seen = run_ranks(driver.rank_spec(), job_coords())
        for trajectory in data:
            driver.write(trajectory)
        driver.finish()
        driver.drain(120)
        join(threads)
        return [seen_json(s) for s in seen], figures(driver)


def test_ranks_on_nodes_with_their_own_dev_shm_run_the_job_as_on_one_node(tmp_path: Path) -> None:
    """Invariant: where the ranks run does not change what they train. The driver (with the Ray
    head) runs on node 0, ranks 0-1 on node 1 and ranks 2-3 on node 2, each node with a private
    /dev/shm; reorganizers (``RayDispatcher``) and control relays (``RayControl``) are pinned to
    the ranks' nodes, units are in a ``RayBackend`` on node 0. Every pass of every mini-batch
    is served and trained exactly once per token, every forward-only output comes back (the
    next pass reads it bit for bit), and every rank sees the same tokens per (mini-batch, pass)
    as in the same job on one node; the driver's counts agree too. On bf68f6a the ranks
    cannot attach (``DriverNotFoundError``: the schedule ring is in node 0's /dev/shm)."""
    reference, reference_figures = _one_node()
    with SimulatedCluster(3) as cluster:
        rank_nodes = [cluster.node(1 + r // RANKS_PER_NODE) for r in range(len(job_coords()))]
        driver = cluster.node(0).popen(
            [sys.executable, SCRIPT, "ray-driver", *(n.address for n in rank_nodes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert driver.stdin is not None and driver.stdout is not None
        spec = driver.stdout.readline()
        assert spec.startswith("{"), "the driver did not start"
        nodes = json.loads(spec)["nodes"]
        assert len(set(nodes)) == 2 and nodes[0] == nodes[1] != nodes[2] == nodes[3]
        spec_file = tmp_path / "spec.json"  # /tmp is every node's
        spec_file.write_text(spec)
        ranks = [  # every node's ranks start at once: they train together
            cluster.node(n).popen(
                [sys.executable, SCRIPT, "ranks", str(first), str(RANKS_PER_NODE), str(spec_file)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for n, first in ((1, 0), (2, RANKS_PER_NODE))
        ]
        outs = [process.communicate(timeout=300)[0] for process in ranks]
        assert [p.returncode for p in ranks] == [0, 0], outs
        got = [s for out in outs for s in json.loads(out)]
        assert [s["error"] for s in got if s["error"]] == [], [s["error"][-2000:] for s in got]
        driver_figures = json.loads(driver.stdout.readline())
        driver.stdin.close()
        assert driver.wait(120) == 0
    assert [m for s in got for m in s["mismatches"]] == []
    assert got == reference
    assert driver_figures == reference_figures
    whole = Counter(tok for t in job_data() for tok in token_ids(t))
    for name in ("old", "train"):
        trained = Counter(
            tok
            for s in got
            if s["rank"] % JOB["tp"] == 0  # one TP rank per group: its tokens once
            for key, tokens in s["tokens"].items()
            if key.endswith(f"/{name}")
            for tok in tokens
        )
        assert trained == whole, name
