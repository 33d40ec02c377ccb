"""benchmarks/native_floor.py measures knitkit's own delivery with the Python taken out: its spec
must be knitkit's copies of transfer.py's eager step, and its C program must run them."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from benchmark_scripts import load

from knitkit.storage.planning import pack
from knitkit.types import MicroBatchLayout


@pytest.fixture(scope="module")
def floor() -> ModuleType:
    return load("native_floor")


@pytest.fixture(scope="module")
def work(floor: ModuleType):
    """transfer.py's workload, small: 2 steps (warm-up and one measured) of short trajectories."""
    transfer = floor.transfer
    sizes = dataclasses.replace(
        transfer.QUICK,
        steps=1,
        min_tokens=64,
        max_tokens=700,
        routing_layers=2,
        image_patches=16,
        patch_dim=8,
        micro_batch_tokens=512,
    )
    workload = transfer.build_workload(sizes)
    yield workload
    workload.store.backend.close()


def _slots(words: list[int], files: list[np.ndarray]) -> list[list[list[bytes]]]:
    """Each ring's slot bytes per step, the spec's copies run in Python (as native_floor.c
    reads the spec), into slots that held other bytes."""
    at = 4
    num_rings, steps = words[0], words[2]
    rings = []
    for _ in range(num_rings):
        _, slot_bytes, _ = words[at : at + 3]
        at += 3
        per_step = []
        for _ in range(steps):
            count, at = words[at], at + 1
            micro_batches = []
            for _ in range(count):
                nbytes, copies = words[at : at + 2]
                at += 2
                slot = np.full(slot_bytes, 0xAB, np.uint8)
                for _ in range(copies):
                    source, offset, to, size = words[at : at + 4]
                    at += 4
                    slot[to : to + size] = files[source][offset : offset + size]
                micro_batches.append(slot[:nbytes].tobytes())
            per_step.append(micro_batches)
        rings.append(per_step)
    return rings


def test_the_floor_fills_every_slot_with_the_bytes_knitkit_packs(floor: ModuleType, work) -> None:
    """Every backbone micro-batch the floor's copies fill is the straightforward packer's buffer
    byte for byte, and every encoder micro-batch holds each unit's bytes at its field: the
    floor moves what knitkit delivers, nothing less."""
    transfer = floor.transfer
    spec = floor.floor_spec(work)
    got = _slots(spec.words, [np.frombuffer(spec.sources, np.uint8)])
    backend = work.store.backend
    schema = transfer.schema_of(work.store, work.plans)
    ring = 0
    for d in range(transfer.TOPOLOGY.dp):
        for c in range(transfer.TOPOLOGY.cp):
            for step, plan in enumerate(work.plans):
                micro_batches = plan.consumer(d, c).micro_batches
                assert len(got[ring][step]) == len(micro_batches)
                for micro_batch, slot in zip(micro_batches, got[ring][step], strict=True):
                    _, want = pack(
                        micro_batch,
                        schema,
                        lambda r, out: backend.read(r.key, r.ranges, out=out),
                    )
                    assert slot == want.tobytes(), f"dp{d}cp{c} step {step} {micro_batch.index}"
            ring += 1
    for r in range(transfer.ENCODER.dp):
        for step, plan in enumerate(work.plans):
            units = plan.encoder(transfer.ENCODER.name).ranks[r].micro_batches
            assert len(got[ring][step]) == len(units)
            for keys, slot in zip(units, got[ring][step], strict=True):
                assert keys, "an encoder micro-batch with no unit"
                layout = MicroBatchLayout.of_units(
                    {k: (backend.spec(k).dtype, backend.spec(k).shape) for k in keys}
                )
                views = layout.unit_views(np.frombuffer(slot, np.uint8))
                for key in keys:
                    assert np.array_equal(views[key], backend.read(key)), f"vision{r} {key}"
        ring += 1
    assert ring == spec.num_rings


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler (cc or gcc) here to build benchmarks/native_floor.c",
)
def test_the_floor_runs_every_step_and_counts_its_cpu(
    floor: ModuleType, work, tmp_path: Path
) -> None:
    """The compiled floor runs the spec's steps in its processes and reports every figure: a
    wait per step, fills inside their producers' CPU (a thread's time within its process's)."""
    figures = floor.run_floor(work, tmp_path)
    assert figures["floor.exposed_s_per_step"] > 0
    assert 0 < figures["floor.cpu_s_per_step.fills"] <= figures["floor.cpu_s_per_step.producers"]
    assert figures["floor.cpu_s_per_step.ranks"] > 0
