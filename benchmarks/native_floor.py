"""The native floor of knitkit's eager delivery: transfer.py's eager step with no Python on the path.

transfer.py's eager knitkit figure (the slowest rank's wait for its step's data, no compute, no
look-ahead across the step's start) against what the same delivery costs with every Python
layer taken out (``native_floor.c``, compiled here with the system's C compiler): the same
stored trajectories and plans, each micro-batch the copies that lay out the straightforward
packer's bytes (``pack_into``, which every reorganizer's copy list matches byte for byte), one
producer process per ring running them into 2-slot rings, one process per rank waiting on each
ring's futex and releasing each micro-batch as it gets it (NOTE [ What the floor leaves out ]).
Then, in the same invocation, transfer.py's knitkit, sample-level and broadcast phases
(``--skip-tq --skip-engines``; ``--quick`` passes on), each part started once the 1-minute load
average is below ``QUIET_LOAD`` (waiting at most ``QUIET_WAIT_S``). benchmarks/README.md
(native_floor.py) lists the keys and what the floor says of issue 31's targets.

    python benchmarks/native_floor.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import transfer
from lifetime import end_on_sigterm
from progress import Progress
from report import finish

from knitkit.storage import MicroBatchPlan, UnitBackend
from knitkit.storage.delivery import streaming_copies
from knitkit.storage.planning import RowSpec, pack_into, pack_layout
from knitkit.testing import run_to_end
from knitkit.types import MicroBatchLayout, UnitKey, UnitRead

HERE = Path(__file__).parent
QUIET_LOAD = 1.0
QUIET_WAIT_S = 300.0
COMPILE_TIMEOUT_S = 120
FLOOR_TIMEOUT_S = 600
TRANSFER_TIMEOUT_S = 1800
SHARED_MEMORY = "/dev/shm"
EAGER_SLOTS = 2
"""transfer.py's eager rings: depth 1 + the held micro-batch."""
COMPARED = ("knitkit", "sample_level", "sample_level_bcast")

# NOTE [ What the floor leaves out ]: the floor keeps what every delivery of this design must
# do on this machine: the one copy of every delivered byte into a ring slot (the packer's
# layout: each range of each unit read one copy, each run of bytes the packer writes itself one
# copy, as a reorganizer's copy list has them, with the reorganizers' glibc non-temporal
# threshold), 2-slot rings, a release store per publication and per release, a futex wait where
# a side must sleep and a wake only when the other side said it sleeps (NOTE [ Futex waits ] in
# knitkit/storage/delivery/atomic_words.py), mappings populated before the first step. It
# leaves out everything else knitkit does per step: the driver's planning and submission, the
# reorganizers' assignment receive, compile, unit views and layout records, the ranks' layout
# decode, lease, iterator and tensors, and transfer.py's step barrier in Python (its C barrier
# is one futex word; ``.with_barriers`` adds transfer.py's ``oracle.cpu_s_per_step`` back). So
# the floor bounds any implementation from below, a compiled one included. Its sources are one
# shared-memory file holding every unit the steps read once (``Sources``), not the store's
# slabs: the slabs' layout is the store's own (no face shows it), and a unit's bytes are the
# same wherever they lie.

progress = Progress("native_floor")


def compile_floor(workdir: Path) -> Path:
    """``native_floor.c`` built with the system's C compiler (``CC``, else cc)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("native_floor: no C compiler (cc, gcc or $CC) to build native_floor.c")
    binary = workdir / "native_floor"
    subprocess.run(
        [compiler, "-O2", "-Wall", "-o", str(binary), str(HERE / "native_floor.c")],
        check=True,
        timeout=COMPILE_TIMEOUT_S,
    )
    return binary


class Sources:
    """The bytes the floor's copies read, in one owner-only file it maps: every unit the steps
    read, whole, once each (as the store holds them), then the bytes the packer writes itself
    (padding, alignment, generated masks and positions, sequence bounds), equal runs once."""

    def __init__(self, backend: UnitBackend) -> None:
        self.backend = backend
        self.blob = bytearray()
        self.units: dict[UnitKey, int] = {}
        self.runs: dict[bytes, int] = {}

    def unit(self, key: UnitKey) -> int:
        """Where unit ``key``'s bytes start (placed at its first read, 64-byte aligned)."""
        if key not in self.units:
            self._align()
            self.units[key] = len(self.blob)
            self.blob += np.ascontiguousarray(self.backend.read(key)).view(np.uint8).tobytes()
        return self.units[key]

    def run(self, data: bytes) -> int:
        """Where a run of bytes the packer wrote itself starts (each distinct run once)."""
        if data not in self.runs:
            self._align()
            self.runs[data] = len(self.blob)
            self.blob += data
        return self.runs[data]

    def _align(self) -> None:
        self.blob += bytes(-len(self.blob) % 64)


def packed_copies(
    backend: UnitBackend, schema: dict[str, RowSpec], micro_batch: MicroBatchPlan, out: Sources
) -> list[int]:
    """A backbone micro-batch as the straightforward packer lays it out (``pack_into``, whose
    bytes every reorganizer's copy list matches: tests/storage/test_reorg_copy_lists.py):
    ``[slot bytes, copies, (0, source offset, slot offset, bytes)...]``, one copy per range of
    each unit read, one per run of bytes the packer writes itself."""
    layout = pack_layout(micro_batch, schema)
    buffer = np.zeros(layout.nbytes, np.uint8)
    base, copies = buffer.ctypes.data, []

    def read(unit: UnitRead, into: np.ndarray) -> None:
        if unit.columns is not None:
            raise ValueError(f"{unit.key}: column reads (pipeline stages) are not in the floor")
        spec = backend.spec(unit.key)
        row = spec.nbytes // spec.shape[0] if spec.shape else spec.nbytes
        at = into.ctypes.data - base
        if not 0 <= at <= at + into.nbytes <= buffer.nbytes:
            raise ValueError(f"{unit.key}: the packer read it outside the micro-batch's buffer")
        for start, stop in unit.ranges or [(0, spec.shape[0] if spec.shape else 1)]:
            copies.append((out.unit(unit.key) + start * row, at, (stop - start) * row))
            at += (stop - start) * row

    pack_into(micro_batch, layout, buffer, read)
    return _with_the_rest(buffer, copies, out)


def encoder_copies(backend: UnitBackend, units: tuple[UnitKey, ...], out: Sources) -> list[int]:
    """An encoder micro-batch (each unique unit whole, ``MicroBatchLayout.of_units``) in the
    same form as ``packed_copies``."""
    layout = MicroBatchLayout.of_units(
        {k: (backend.spec(k).dtype, backend.spec(k).shape) for k in units}
    )
    buffer = np.zeros(layout.nbytes, np.uint8)
    copies = []
    for key, view in layout.unit_views(buffer).items():
        copies.append((out.unit(key), view.ctypes.data - buffer.ctypes.data, view.nbytes))
    return _with_the_rest(buffer, copies, out)


def _with_the_rest(
    buffer: np.ndarray, copies: list[tuple[int, int, int]], out: Sources
) -> list[int]:
    """``copies`` (source, slot offset, bytes) and a copy for every run of ``buffer`` they do
    not write, from its bytes (the packer's own; the units' ranges are left unread there: their
    bytes come from ``Sources``), flattened in slot order."""
    unwritten = np.ones(buffer.nbytes, np.int8)
    for _, at, size in copies:
        unwritten[at : at + size] = 0
    edges = np.diff(np.concatenate(([0], unwritten, [0])))
    for start, stop in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True):
        copies.append((out.run(buffer[start:stop].tobytes()), int(start), int(stop - start)))
    flat = [buffer.nbytes, len(copies)]
    for source, at, size in sorted(copies, key=lambda copy: copy[1]):
        flat += [0, source, at, size]
    return flat


@dataclass(frozen=True, slots=True)
class Spec:
    """What native_floor.c runs: its words (in the order it reads them) and the bytes its
    copies read (``Sources``)."""

    words: list[int]
    sources: bytes
    num_rings: int
    copies_per_step: float


def floor_spec(work: transfer.Workload) -> Spec:
    """Every ring of transfer.py's eager phase (4 backbone groups, 2 encoder ranks), every step's
    micro-batches as copies, and which rings each rank takes from."""
    backend = work.store.backend
    backbone_bytes, encoder_bytes, _ = transfer.slot_bytes(work.store, work.plans)
    schema = transfer.schema_of(work.store, work.plans)
    out = Sources(backend)
    rings: list[tuple[int, int, list[list[list[int]]]]] = []  # slot, consumers, per step
    backbone = {}
    for d in range(transfer.TOPOLOGY.dp):
        for c in range(transfer.TOPOLOGY.cp):
            backbone[(d, c)] = len(rings)
            steps = [
                [
                    packed_copies(backend, schema, mb, out)
                    for mb in plan.consumer(d, c).micro_batches
                ]
                for plan in work.plans
            ]
            rings.append((backbone_bytes, transfer.TOPOLOGY.tp, steps))
    encoder = []
    for r in range(transfer.ENCODER.dp):
        encoder.append(len(rings))
        steps = [
            [
                encoder_copies(backend, units, out)
                for units in plan.encoder(transfer.ENCODER.name).ranks[r].micro_batches
            ]
            for plan in work.plans
        ]
        rings.append((encoder_bytes, 1, steps))
    words = [len(rings), len(transfer.RANKS), len(work.plans), transfer.WARMUP_STEPS]
    copies = 0
    for slot, consumers, steps in rings:
        words += [EAGER_SLOTS, slot, consumers]
        for micro_batches in steps:
            words.append(len(micro_batches))
            for flat in micro_batches:
                words += flat
                copies += flat[1]
    for rank in transfer.RANKS:  # the encoder ring first, as transfer.py's TP0/CP0 takes it
        taken = [(encoder[rank.dp], 0)] if rank.reads_multimodal else []
        taken.append((backbone[(rank.dp, rank.cp)], rank.tp))
        words.append(len(taken))
        for ring, index in taken:
            words += [ring, index]
    return Spec(words, bytes(out.blob), len(rings), copies / len(work.plans))


def run_floor(work: transfer.Workload, workdir: Path) -> dict[str, float]:
    """The floor over ``work``'s steps (the first ``WARMUP_STEPS`` left out): its figures."""
    binary = compile_floor(workdir)
    spec, out = workdir / "spec.bin", workdir / "out.bin"
    floor = floor_spec(work)
    np.asarray(floor.words, dtype="<i8").tofile(spec)
    env = streaming_copies(os.environ)  # the fills stream past the cache, as reorganizers' do
    with tempfile.TemporaryDirectory(prefix="knitkit-floor-", dir=SHARED_MEMORY) as shm:
        sources = Path(shm) / "sources"  # shared memory, as the store's slabs (owner-only)
        sources.write_bytes(floor.sources)
        command = [str(binary), str(spec), str(out), str(sources)]
        run_to_end(command, timeout_s=FLOOR_TIMEOUT_S, env=env).check_returncode()
    ranks, steps = len(transfer.RANKS), len(work.plans)
    values = np.fromfile(out, dtype="<i8")
    exposed = values[: ranks * steps].reshape(ranks, steps)[:, transfer.WARMUP_STEPS :] / 1e9
    per_process = values[ranks * steps :].reshape(ranks + floor.num_rings, 2) / 1e9
    measured = steps - transfer.WARMUP_STEPS
    figures = {
        "floor.exposed_s_per_step": float(np.median(exposed.max(axis=0))),
        "floor.cpu_s_per_step.ranks": float(per_process[:ranks, 0].sum() / measured),
        "floor.cpu_s_per_step.producers": float(per_process[ranks:, 0].sum() / measured),
        "floor.cpu_s_per_step.fills": float(per_process[ranks:, 1].sum() / measured),
        "floor.copies_per_step": floor.copies_per_step,
    }
    figures["floor.cpu_s_per_step"] = (
        figures["floor.cpu_s_per_step.ranks"] + figures["floor.cpu_s_per_step.producers"]
    )
    return figures


def wait_quiet() -> float:
    """Until the 1-minute load average is below QUIET_LOAD, at most QUIET_WAIT_S; the load
    average then."""
    deadline = time.monotonic() + QUIET_WAIT_S
    while (load := os.getloadavg()[0]) >= QUIET_LOAD and time.monotonic() < deadline:
        time.sleep(5)
    return load


def run_transfer(quick: bool, workdir: Path) -> dict[str, float]:
    """transfer.py's knitkit and sample-level phases (no TQ, no engines), its JSON."""
    path = workdir / "transfer.json"
    command = [sys.executable, str(HERE / "transfer.py"), "--skip-tq", "--skip-engines"]
    command += ["--methods", ",".join(COMPARED), "--json", str(path)]
    command += ["--quick"] if quick else []
    run_to_end(command, timeout_s=TRANSFER_TIMEOUT_S).check_returncode()
    return json.loads(path.read_text())


def against_transfer(floor: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    """transfer.py's figures of the same run the floor is set against, and the ratios."""
    memcpy_bps = measured["memcpy_gbps"] * 1e9
    consumed, barriers = measured["bytes_consumed_per_step"], measured["oracle.cpu_s_per_step"]
    floor_cpu = floor["floor.cpu_s_per_step"]
    figures = {
        key: measured[key]
        for key in ("memcpy_gbps", "bytes_consumed_per_step", "steps", "oracle.cpu_s_per_step")
    }
    figures["floor.delivered_fraction_of_memcpy"] = consumed / floor_cpu / memcpy_bps
    figures["floor.delivered_fraction_of_memcpy.with_barriers"] = (
        consumed / (floor_cpu + barriers) / memcpy_bps
    )
    for key in ("delivered_fraction_of_memcpy", "cpu_s_per_step", "fill_cpu_s_per_step"):
        figures[f"eager.knitkit.{key}"] = measured[f"eager.knitkit.{key}"]
    for method in COMPARED:
        key = f"eager.{method}.exposed_s_per_step"
        figures[key] = measured[key]
        figures[f"{method}_over_floor"] = measured[key] / floor["floor.exposed_s_per_step"]
    return figures


def table(figures: dict[str, float]) -> None:
    print(
        f"eager exposed wait per step, slowest rank: floor {figures['floor.exposed_s_per_step']:.4f} s"
    )
    for method in COMPARED:
        print(
            f"  {method:<20} {figures[f'eager.{method}.exposed_s_per_step']:.4f} s "
            f"({figures[f'{method}_over_floor']:.1f}x the floor)"
        )
    print(
        f"eager CPU per step: knitkit {figures['eager.knitkit.cpu_s_per_step']:.4f} s (its fills "
        f"{figures['eager.knitkit.fill_cpu_s_per_step']:.4f})"
    )
    print(
        f"floor CPU per step {figures['floor.cpu_s_per_step']:.4f} s (producers "
        f"{figures['floor.cpu_s_per_step.producers']:.4f}, of it fills "
        f"{figures['floor.cpu_s_per_step.fills']:.4f}; ranks {figures['floor.cpu_s_per_step.ranks']:.4f}); "
        f"delivered fraction of memcpy {figures['floor.delivered_fraction_of_memcpy']:.2f}, "
        f"{figures['floor.delivered_fraction_of_memcpy.with_barriers']:.2f} with transfer.py's "
        f"step barriers (knitkit's eager: "
        f"{figures['eager.knitkit.delivered_fraction_of_memcpy']:.2f})"
    )
    print(
        f"load average (1 min) at start / the floor / transfer.py / end: "
        f"{figures['loadavg_1m_at_start']:.1f} / {figures['loadavg_1m_at_floor']:.1f} / "
        f"{figures['loadavg_1m_at_transfer']:.1f} / {figures['loadavg_1m_at_end']:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="transfer.py's --quick steps")
    parser.add_argument("--json", metavar="PATH", help="write the figures as one flat JSON object")
    args = parser.parse_args()
    end_on_sigterm()  # a SIGTERM ends the floor's processes and transfer.py's too (lifetime.py)
    sizes = transfer.QUICK if args.quick else transfer.FULL
    figures: dict[str, float] = {"loadavg_1m_at_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="knitkit-floor-") as tmp:
        workdir = Path(tmp)
        work = transfer.build_workload(sizes)
        try:
            progress("stored and planned; the native floor, once the 1-minute load is below 1.0")
            figures["loadavg_1m_at_floor"] = wait_quiet()
            figures.update(run_floor(work, workdir))
        finally:
            work.store.backend.close()
        progress("transfer.py's knitkit and sample-level phases, once the load is below 1.0")
        figures["loadavg_1m_at_transfer"] = wait_quiet()
        measured = run_transfer(args.quick, workdir)
    figures.update(against_transfer(figures, measured))
    finish(figures, table, {}, args.json)


if __name__ == "__main__":
    main()
