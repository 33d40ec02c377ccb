"""The example's driver in a process of its own, for ranks on other nodes of a Ray cluster (``--serve``)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from grpo.config import GRPOConfig
from grpo.knit import DATA_RING_SLOTS, _Feed, build_driver
from knitkit.integration.megatron import MegatronLayout
from knitkit.job import RankSpec
from knitkit.job.spec import encoder_rank_name, group_name
from knitkit.storage import Topology, TrajectoryStore

SPEC_WAIT_S = 600.0
"""How long a rank waits for the driver's spec file (Ray and the relays start first)."""


def megatron_layout(world_size: int, tensor_parallel: int) -> MegatronLayout:
    """The DP x TP layout megatron's default rank order gives (TP ranks adjacent: ``tp-cp-ep-dp-pp``),
    for a driver outside the torchrun world; every rank checks it (``check_layout``)."""
    coords = tuple((r // tensor_parallel, 0, r % tensor_parallel) for r in range(world_size))
    topology = Topology(dp=world_size // tensor_parallel, tp=tensor_parallel)
    return MegatronLayout(topology, coords, tuple(c[0] for c in coords), 0)


def serve(
    run: GRPOConfig, spec_file: Path, rank_nodes: Sequence[str], tensor_parallel: int
) -> None:
    """The driver on this node of a Ray cluster (``ray.init()`` joins it): units in a
    ``RayBackend``, each group's reorganizer and each node's control relay (``RayControl``) on its
    ranks' node (``rank_nodes[r]``: the address of rank ``r``'s node). Writes the ``RankSpec`` to
    ``spec_file`` (ranks read it: ``--spec-file``), writes every step's groups, drains."""
    import ray

    from knitkit.integration.ray import RayBackend, RayControl, RayDispatcher, RingConfig

    ray.init(logging_level="ERROR", log_to_driver=False)
    ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    placement = [ids[address] for address in rank_nodes]
    layout = megatron_layout(len(placement), tensor_parallel)
    groups = {
        group_name(dp, cp): placement[r] for r, (dp, cp, tp) in enumerate(layout.coords) if tp == 0
    }
    groups |= {encoder_rank_name("vision", r): node for r, node in enumerate(placement)}
    backend = RayBackend()
    try:
        pool = RayDispatcher(
            backend,
            layout.topology,
            encoders=(layout.encoder_topology(),),
            placement=groups,
            ring=RingConfig(num_slots=DATA_RING_SLOTS, slot_bytes=1 << 20),  # as build_driver
            liveness_timeout_s=30.0,  # the ranks' bound: Driver.Config's default
        )
        control = RayControl(placement)
        with build_driver(
            run, layout, store=TrajectoryStore(backend), pool=pool, control=control
        ) as driver:
            staged = spec_file.with_suffix(".tmp")
            staged.write_text(driver.rank_spec(coords=[list(c) for c in layout.coords]).to_json())
            os.replace(staged, spec_file)  # ranks never read half a spec
            _Feed(run, driver, None).until_admitted(run.steps)
            driver.finish()
            driver.drain()
    finally:
        backend.close()
        ray.shutdown()


def read_spec(spec_file: Path) -> RankSpec:
    """The driver's spec, once ``serve`` wrote it (``TimeoutError`` after ``SPEC_WAIT_S``)."""
    deadline = time.monotonic() + SPEC_WAIT_S
    while not spec_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no driver wrote {spec_file} within {SPEC_WAIT_S} s (--serve)")
        time.sleep(0.1)
    return RankSpec.from_json(spec_file.read_text())


def check_layout(spec: RankSpec, layout: MegatronLayout) -> None:
    """The driver planned for this world's rank order (``megatron_layout``), or ``ValueError``."""
    planned = [tuple(c) for c in spec.extra.get("coords", ())]
    if planned != list(layout.coords):
        raise ValueError(
            f"the driver planned ranks at {planned}, megatron placed them at "
            f"{list(layout.coords)}: start torchrun with megatron's default rank order"
        )
