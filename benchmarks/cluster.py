"""Cluster benchmark: transfer.py's workload on four simulated nodes with a link cap, data path only.

Node 0 runs the driver (planning, the unit directory), node 1 the rollout writer, nodes 2 and 3
one DP group each (its CP2 x TP2 backbone ranks and its vision encoder rank, as Ray actors, and
knitkit's reorganizers for that group). Every node has its own /dev/shm, network namespace and
raylet; every link is capped (``--link-mbit``, each way). Methods, on the same steps:

- knitkit: the writer places units on its node (``UnitPlacer``), the driver adopts the records
  (metadata only), plans each step and dispatches it to reorganizer actors on the consumers'
  nodes, which read through Ray and publish packed micro-batches into node-local rings;
- knitkit_via_driver: the same, but the writer sends whole trajectories to the driver, which
  stores them (``TrajectoryStore.write``, the path before placement: every byte through it);
- knitkit_cp_split: knitkit with each DP group's two CP ranks on different nodes (node 2 holds
  CP0, node 3 CP1), so both nodes pull the same whole units: Ray's whole-object cost;
- knitkit_mooncake_cp_split: knitkit_cp_split over Mooncake's store (a master on node 0, the
  writer's segment on node 1, each reorganizer a client on its own node): the reorganizers read
  only their CP chunks' rows over Mooncake's TCP transfer engine; run only where Mooncake loads,
  skipped with the reason (``mooncake.skipped``) elsewhere, never stood in for;
- sample_level: every rank reads its share's whole units through Ray (TP0/CP0 also the images)
  and packs its own micro-batches (``knitkit.storage.baselines``);
- transferqueue: the writer puts one TransferQueue row per trajectory (TQ's controller and
  storage units are Ray actors where Ray places them), every rank gets its DP share's whole rows
  (``read_share_tq``; TP0/CP0 the image column too) and packs its own micro-batches.

- knitkit_job: the whole job: a ``Driver`` on node 0 with ``RayControl`` (a control relay on
  each consumer node) and the same reorganizer placement as knitkit, the writer's units adopted
  (``Driver.adopt``), real ``RankHandle`` ranks, one process each, on nodes 2 and 3; each step
  is two passes, a forward-only one that writes back a per-token field and a train pass that
  reads it (``_job_passes``).

Ranks do no compute: the figure is the eager wait (NOTE [ Eager wait across nodes ]). The
methods before knitkit_job measure the data path alone (writer, driver, reorganizers,
consumers); knitkit_job adds the control records, the write-backs and the ranks' own handles.

    python benchmarks/cluster.py [--quick] [--json PATH] [--link-mbit 1000] [--methods a,b]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from lifetime import end_on_sigterm
from report import finish

NAMESPACE = "knitkit-cluster-bench"
METHODS = (
    "knitkit",
    "knitkit_via_driver",
    "knitkit_cp_split",
    "knitkit_mooncake_cp_split",
    "sample_level",
    "transferqueue",
    "knitkit_job",
)
TQ_PARTITION = "cluster-bench"
WARMUP_STEPS = 1
NODES = 4
LINK_MBIT = 1000.0

# NOTE [ Eager wait across nodes ]:
# A step starts when the driver has its trajectories' metadata (the rollout is done: placing
# the units is rollout work, outside the step); its wait is the wall time from the start of
# planning to the moment the slowest rank holds every micro-batch of the step (knitkit: planning,
# dispatch, the reorganizers' reads through Ray and publication, the consumers' hand-outs;
# sample-level: every rank's whole-unit reads and its own packing), measured by the driver with
# one monotonic clock (the nodes share the machine's). CPU is that of every process on every node
# (Ray's services included, the same for every method) over the phase's measured steps,
# placement included; network bytes are each node link's kernel counters over the same steps.
# knitkit_job: the step starts as the driver adopts its last trajectory (admission then plans
# the mini-batch inside the driver) and ends when the slowest rank holds the last micro-batch of
# the step's train pass, by the rank's own monotonic clock: planning, both passes' dispatch, the
# forward-only pass, its write-backs reaching the store and the train pass's reads included.
# Consumed bytes count what each pass reads (the images once: NOTE [ Encoder inputs once per
# mini-batch ] in knitkit/job/rank.py), the written-back field in the train pass's.

JOB_OUTPUT = "old_lp"
"""The per-token field knitkit_job's forward-only pass writes back and its train pass reads."""
DRAIN_S = 600.0
"""Bound of one knitkit_job step (generous: 2 loaded cores, 1000 Mbit/s links)."""


def _rss() -> int:
    gc.collect()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS in /proc/self/status")


# ----- actors (defined here, shipped by value to the nodes) ---------------------------------------
def _actors() -> tuple[Any, Any]:
    import numpy as np
    import ray

    from knitkit.integration.ray import RayBackend
    from knitkit.storage import MicroBatchConsumer, UnitPlacer
    from knitkit.storage.baselines import RankPosition, pack_local, read_share, share_reads
    from knitkit.storage.baselines import synthetic_trajectories as synthetic

    @ray.remote(num_cpus=0)
    class Writer:
        """The rollout writer (node 1): owns the units it places."""

        def __init__(self, make_backend: Any, sizes: dict[str, int], per_step: int) -> None:
            self.placer, self.sizes, self.per_step = UnitPlacer(make_backend()), sizes, per_step

        def _step(self, phase: int, step: int) -> list[Any]:
            group = self.sizes["group_size"]
            made = synthetic(self.per_step // group, seed=1000 * phase + step, **self.sizes)
            tag = f"p{phase}s{step}"
            return [
                dataclasses.replace(
                    t, trajectory_id=f"{tag}{t.trajectory_id}", sample_id=f"{tag}{t.sample_id}"
                )
                for t in made
            ]

        def place(self, phase: int, step: int) -> list[dict[str, Any]]:
            return [self.placer.place(t).to_dict() for t in self._step(phase, step)]

        def trajectories(self, phase: int, step: int) -> list[Any]:
            return self._step(phase, step)

        def transferqueue(
            self, connection: Any, phase: int, step: int, fields: list[str]
        ) -> tuple[list[Any], int]:
            """Put the step's rows into TQ; their metadata and the bytes a step consumes."""
            from knitkit.integration.transferqueue import put_trajectories

            if not hasattr(self, "client"):
                self.client = connection.client()
            made = self._step(phase, step)
            put_trajectories(self.client, made, TQ_PARTITION)
            images = {m.key: m.data.nbytes for t in made for m in t.multimodal}
            own = sum(
                np.asarray({**t.token_fields, **t.scalars}[f]).nbytes for t in made for f in fields
            )
            return [t.meta() for t in made], own + sum(images.values())

    @ray.remote(num_cpus=0)
    class Ranks:
        """The ranks of one node: knitkit consumers on its rings, or sample-level readers."""

        def __init__(self) -> None:
            self.consumers: dict[tuple[str, int], MicroBatchConsumer] = {}

        def attach(self, rings: dict[str, Any]) -> None:
            self.close()
            self.consumers = {
                (name, r): MicroBatchConsumer(spec, r)
                for name, spec in rings.items()
                for r in range(spec.num_consumers)
            }

        def take(self, counts: dict[str, int]) -> int:
            """Every TP rank of every ring here takes its ``counts[ring]`` micro-batches."""

            def run(key: tuple[str, int], out: list[int]) -> None:
                for lease in self.consumers[key].take(counts[key[0]]):
                    with lease:
                        out.append(lease.layout.nbytes)

            return _threads([(run, key) for key in self.consumers if key[0] in counts])

        def sample_level(self, backend: Any, plan: Any, ranks: list[tuple[int, int, int]]) -> int:
            """Every rank here reads its share whole and packs its micro-batches."""

            def run(position: tuple[int, int, int], out: list[int]) -> None:
                rank = RankPosition(*position)
                mine = RayBackend(backend.name, create=False)  # each rank its own handle
                mine.resolve(share_reads(plan, rank))  # one directory lookup, as a careful user
                local = read_share(mine, plan, rank)
                mine.close()
                group = plan.consumer(rank.dp, rank.cp)
                out.extend(buffer.nbytes for _, buffer in pack_local(group, local))

            return _threads([(run, p) for p in ranks])

        def transferqueue(
            self, connection: Any, plan: Any, ranks: list[tuple[int, int, int]]
        ) -> int:
            """Every rank here gets its DP share's whole TQ rows and packs its micro-batches."""
            from knitkit.integration.transferqueue import read_share_tq

            clients = self.__dict__.setdefault("tq_clients", {})
            for position in ranks:
                if position not in clients:
                    clients[position] = connection.client()

            def run(position: tuple[int, int, int], out: list[int]) -> None:
                rank = RankPosition(*position)
                local, _ = read_share_tq(clients[position], plan, rank, TQ_PARTITION)
                group = plan.consumer(rank.dp, rank.cp)
                out.extend(buffer.nbytes for _, buffer in pack_local(group, local))

            return _threads([(run, p) for p in ranks])

        def close(self) -> None:
            for consumer in self.consumers.values():
                consumer.close()
            self.consumers = {}

    return Writer, Ranks


def _ray_backend(name: str) -> Any:
    """The writer's handle on the driver's ``RayBackend`` (its puts stay on the writer's node)."""
    from knitkit.integration.ray import RayBackend

    return RayBackend(name, create=False)


def _mooncake_owner(master: Any, namespace: str, segment_bytes: int) -> Any:
    """The writer's Mooncake client of ``namespace``, its segment on this node's address (its
    pickled copies attach on their own node's: ``integration/mooncake/backend.py``)."""
    import ray

    from knitkit.integration.mooncake import MooncakeBackend

    here = ray.util.get_node_ip_address()
    return MooncakeBackend(
        master, namespace=namespace, segment_bytes=segment_bytes, local_hostname=here
    )


def _threads(work: list[tuple[Any, Any]]) -> int:
    """Run ``fn(arg, out)`` for each pair on its own thread; the bytes they appended."""
    out: list[int] = []
    errors: list[BaseException] = []

    def guard(fn: Any, arg: Any) -> None:
        try:
            fn(arg, out)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guard, args=pair) for pair in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sum(out)


# ----- knitkit_job: the passes, the ranks -------------------------------------------------------
def _job_passes() -> tuple[Any, ...]:
    """A forward-only pass (the tokens and the routing it replays, the images) that writes back
    ``JOB_OUTPUT``, then the train pass: every field the other methods deliver and that output."""
    from transfer import FIELDS, SCALARS

    from knitkit.job import Output, Pass

    return (
        Pass(
            "old",
            reads=("tokens", "routing"),
            writes=(Output(JOB_OUTPUT),),
            forward_only=True,
            encodes=True,
        ),
        Pass("train", reads=(*FIELDS, *SCALARS, JOB_OUTPUT), encodes=True),
    )


def _job_coords() -> list[Any]:
    """The ranks of DP2 x CP2 x TP2, DP group ``d`` on node ``2 + d``; encoder rank ``d`` on the
    group's first rank (beside its ``vision/dp<d>`` reorganizer, as in the other methods)."""
    from knitkit.job import RankCoords

    return [
        RankCoords(
            rank=(d * 2 + c) * 2 + t, dp=d, cp=c, tp=t, encoder_rank=d if c == t == 0 else None
        )
        for d in range(2)
        for c in range(2)
        for t in range(2)
    ]


def _rank(spec_file: str, rank: int) -> None:
    """One rank of knitkit_job (its own process): every pass, no compute; prints, per
    (mini-batch, pass), when it got the pass, held its last micro-batch and ended it (JSON)."""
    import torch

    from knitkit.job import RankHandle, RankSpec

    spec = RankSpec.from_json(Path(spec_file).read_text())
    out: dict[str, Any] = {"rank": rank, "passes": {}}
    try:
        with RankHandle(spec, _job_coords()[rank], device="cpu") as handle:
            for work in handle.passes():
                got = time.monotonic()
                with work:
                    work.encoder_inputs()
                    for i, mb in enumerate(work.micro_batches()):
                        if work.pass_.writes:
                            work.write_back(i, {JOB_OUTPUT: mb["tokens"].to(torch.float32)})
                    held = time.monotonic()
                ended = time.monotonic()
                out["passes"][f"{work.minibatch_id}/{work.pass_.name}"] = [got, held, ended]
    except Exception as error:
        out["error"] = f"{type(error).__name__}: {error}"
    print(json.dumps(out), flush=True)


def _job_consumed(placed: list[Any]) -> int:
    """Bytes one knitkit_job step consumes: each pass's reads, the images once."""
    total = sum(4 * p.meta.num_tokens for p in placed)  # JOB_OUTPUT, float32 per token
    for pass_ in _job_passes():
        for p in placed:
            fields = [f for f in pass_.reads if f in p.record.fields]
            total += sum(p.specs[p.record.fields[f]].nbytes for f in fields)
    images = {k: p.specs[k].nbytes for p in placed for k in p.record.inputs}
    return total + sum(images.values())


# ----- the driver (node 0) ------------------------------------------------------------------------
class _Host:
    """The line protocol to the host: marks (the host snapshots CPU and links), asks (it starts
    or collects knitkit_job's ranks) and results."""

    def __init__(self) -> None:
        self.stdin, self.stdout = sys.stdin, sys.stdout

    def mark(self, what: str, method: str) -> None:
        self.ask({"mark": what, "method": method})

    def ask(self, record: dict[str, Any]) -> None:
        """Send ``record``; return once the host answered (it did what the record asks)."""
        print(json.dumps(record), file=self.stdout, flush=True)
        assert self.stdin.readline().strip() == "ok"

    def send(self, record: dict[str, Any]) -> None:
        print(json.dumps(record), file=self.stdout, flush=True)


def _driver(steps: int, addresses: list[str], methods: list[str]) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from transfer import ENCODER, FIELDS, FULL, SCALARS, TOPOLOGY

    from knitkit.integration.ray import RayBackend, RayDispatcher, RingConfig
    from knitkit.storage import PlacedTrajectory, PlannerConfig, TrajectoryStore, plan_minibatch
    from knitkit.types import UnitKey

    host = _Host()
    ray.init(namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
    ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    node = [ids[a] for a in addresses]
    Writer, Ranks = _actors()
    sizes = {
        "group_size": FULL.group_size,
        "min_tokens": FULL.min_tokens,
        "max_tokens": FULL.max_tokens,
        "routing_layers": FULL.routing_layers,
        "routing_topk": 8,
        "image_patches": FULL.image_patches,
        "patch_dim": FULL.patch_dim,
    }
    per_step = FULL.samples_per_step * FULL.group_size
    config = PlannerConfig(
        token_fields=FIELDS, max_tokens_per_micro_batch=FULL.micro_batch_tokens, keep_groups=True
    )
    ranks = {n: Ranks.options(scheduling_strategy=On(node[n], soft=False)).remote() for n in (2, 3)}
    by_dp = {f"backbone/dp{d}/cp{c}": node[2 + d] for d in range(2) for c in range(2)}
    by_cp = {f"backbone/dp{d}/cp{c}": node[2 + c] for d in range(2) for c in range(2)}
    encoders = {f"vision/dp{r}": node[2 + r] for r in range(2)}
    master = connection = None
    for phase, method in enumerate(METHODS):  # a phase's number seeds its data
        if method not in methods:
            continue
        if method == "knitkit_job":
            writer = Writer.options(scheduling_strategy=On(node[1], soft=False))
            _job_phase(host, method, phase, steps, node, writer, sizes, {**by_dp, **encoders})
            continue
        if "mooncake" in method:
            from knitkit.integration.mooncake import MooncakeBackend, MooncakeMaster

            master = MooncakeMaster(host=addresses[0])
            where = master.start()
            namespace = f"bench-{phase}"
            backend = MooncakeBackend(
                where, namespace=namespace, segment_bytes=0, local_hostname=addresses[0]
            )
            make = functools.partial(_mooncake_owner, where, namespace, 1 << 30)
        else:
            backend = RayBackend()
            make = functools.partial(_ray_backend, backend.name)
        if method == "transferqueue":
            from knitkit.integration.transferqueue import start_transfer_queue

            connection = start_transfer_queue()
        store = TrajectoryStore(backend)
        writer = Writer.options(scheduling_strategy=On(node[1], soft=False)).remote(
            make, sizes, per_step
        )
        placement = {**(by_cp if method.endswith("cp_split") else by_dp), **encoders}
        dispatcher = None
        if method.startswith("knitkit"):
            dispatcher = RayDispatcher(
                backend,
                TOPOLOGY,
                encoders=[ENCODER],
                placement=placement,
                ring=RingConfig(num_slots=2, slot_bytes=16 << 20),
            )
            ray.get(
                [
                    ranks[n].attach.remote(
                        {k: s for k, s in dispatcher.rings.items() if placement[k] == node[n]}
                    )
                    for n in (2, 3)
                ]
            )
        waits: list[float] = []
        consumed = delivered = 0
        rss_start = _rss()  # before the warm-up step: what the phase's payload adds to the driver
        for step in range(WARMUP_STEPS + steps):
            if step == WARMUP_STEPS:
                host.mark("start", method)
            if method == "transferqueue":
                names = [*FIELDS, *SCALARS]
                metas, step_bytes = ray.get(
                    writer.transferqueue.remote(connection, phase, step, names)
                )
            elif method == "knitkit_via_driver":
                metas = [store.write(t) for t in ray.get(writer.trajectories.remote(phase, step))]
            else:
                records = ray.get(writer.place.remote(phase, step))
                metas = [store.adopt(PlacedTrajectory.from_dict(r)) for r in records]
            tids = [m.trajectory_id for m in metas]
            started = time.monotonic()
            plan = plan_minibatch(metas, TOPOLOGY, config, (ENCODER,), f"{method}-{step}")
            if dispatcher is not None:
                dispatcher.dispatch(plan)
                counts: dict[str, int] = {c.name: len(c.micro_batches) for c in plan.consumers}
                counts.update(
                    {r.name: len(r.micro_batches) for e in plan.encoders for r in e.ranks}
                )
                took = [
                    ranks[n].take.remote(
                        {k: v for k, v in counts.items() if placement[k] == node[n]}
                    )
                    for n in (2, 3)
                ]
            else:
                source = backend if method == "sample_level" else connection
                took = [
                    getattr(ranks[2 + d], method).remote(
                        source, plan, [(d, c, t) for c in range(2) for t in range(2)]
                    )
                    for d in range(2)
                ]
            got = sum(ray.get(took))
            if step >= WARMUP_STEPS:
                waits.append(time.monotonic() - started)
                delivered += got
                if method == "transferqueue":
                    consumed += step_bytes
                else:
                    fields = [UnitKey(t, f) for t in tids for f in (*FIELDS, *SCALARS)]
                    images = {ref.key for m in metas for ref in m.multimodal}
                    consumed += sum(backend.spec(k).nbytes for k in [*fields, *images])
            if method != "transferqueue":
                store.release(tids)
        host.mark("end", method)
        figures = {"waits": waits, "consumed": consumed, "delivered": delivered}
        figures["rss_growth"] = _rss() - rss_start
        figures["rss"] = _rss()
        if dispatcher is not None:
            figures["metrics"] = dispatcher.metrics()
            ray.get([ranks[n].close.remote() for n in (2, 3)])
            dispatcher.close()
        host.send({"result": method, **figures})
        backend.close()
        ray.kill(writer)
        if method == "transferqueue":
            import transfer_queue

            transfer_queue.close()
        if master is not None:
            master.stop()
            master = None
    host.send({"done": True})


def _job_phase(
    host: _Host,
    method: str,
    phase: int,
    steps: int,
    node: list[str],
    writer_on_node_1: Any,
    sizes: dict[str, int],
    placement: dict[str, str],
) -> None:
    """knitkit_job: a ``Driver`` on this node serving the ranks the host starts on nodes 2 and 3
    (NOTE [ Eager wait across nodes ]); the writer on node 1 places, the driver adopts."""
    import ray
    from transfer import ENCODER, FULL, TOPOLOGY

    from knitkit.admission import build_controller
    from knitkit.integration.ray import RayBackend, RayControl, RayDispatcher, RingConfig
    from knitkit.job import Driver
    from knitkit.storage import PlacedTrajectory, PlannerConfig, TrajectoryStore

    per_step = FULL.samples_per_step * FULL.group_size
    backend = RayBackend()
    make = functools.partial(_ray_backend, backend.name)
    writer = writer_on_node_1.remote(make, sizes, per_step)
    ring = RingConfig(num_slots=2, slot_bytes=16 << 20)
    config = Driver.Config(
        passes=_job_passes(),
        topology=TOPOLOGY,
        encoders=(ENCODER,),
        planner=PlannerConfig(max_tokens_per_micro_batch=FULL.micro_batch_tokens, keep_groups=True),
        slot_bytes=ring.slot_bytes,
        num_slots=ring.num_slots,
    )
    admission = build_controller(
        "streaming", train_batch_size=per_step, num_minibatches=1, sources=["src0", "src1"]
    )
    coords = _job_coords()
    driver = config.build(
        admission=admission,
        store=TrajectoryStore(backend),
        pool=RayDispatcher(
            backend,
            TOPOLOGY,
            encoders=[ENCODER],
            placement=placement,
            ring=ring,
            liveness_timeout_s=config.liveness_timeout_s,
        ),
        control=RayControl([node[2 + c.dp] for c in coords]),
    )
    host.ask({"ranks": driver.rank_spec().to_json(), "nodes": [2 + c.dp for c in coords]})
    starts: dict[str, float] = {}
    consumed = placed_bytes = 0
    rss_start = _rss()
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            host.mark("start", method)
        records = ray.get(writer.place.remote(phase, step))
        placed = [PlacedTrajectory.from_dict(r) for r in records]
        for trajectory in placed[:-1]:
            driver.adopt(trajectory)
        started = time.monotonic()
        driver.adopt(placed[-1])  # admission plans the step's mini-batch
        driver.drain(DRAIN_S)
        if step >= WARMUP_STEPS:
            starts[driver.minibatches()[step]] = started
            consumed += _job_consumed(placed)
            placed_bytes += sum({k: s.nbytes for p in placed for k, s in p.specs.items()}.values())
    host.mark("end", method)
    figures: dict[str, Any] = {"starts": starts, "consumed": consumed, "placed": placed_bytes}
    figures["rss_growth"] = _rss() - rss_start
    figures["rss"] = _rss()
    figures["metrics"] = driver.metrics()
    driver.finish()
    host.ask({"collect": method})  # every rank ended its last pass and exited
    driver.close()
    backend.close()
    ray.kill(writer)
    host.send({"result": method, **figures})


# ----- the host -----------------------------------------------------------------------------------
def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


def _snapshot(cluster: Any) -> dict[str, Any]:
    from knitkit.testing import processes_in

    out: dict[str, Any] = {"cpu": {}, "links": {}}
    for node in cluster.nodes:
        pid_ns = os.readlink(f"/proc/{node.pid}/ns/pid")
        out["cpu"][node.index] = _cpu_ticks(list(processes_in(frozenset({pid_ns}))))
        link = node.link_bytes()
        out["links"][node.index] = (link.sent, link.received)
    return out


class _JobRanks:
    """knitkit_job's rank processes: started on their nodes, collected when the job ends."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.processes: list[subprocess.Popen[str]] = []
        self.seen: list[dict[str, Any]] = []

    def start(self, spec: str, nodes: list[int]) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(spec)  # /tmp is every node's
        self.spec_file = f.name
        me = [sys.executable, str(Path(__file__).resolve()), "--role", "rank"]
        self.processes = [
            self.cluster.node(n).popen(
                [*me, "--spec-file", f.name, "--rank", str(r)], stdout=subprocess.PIPE, text=True
            )
            for r, n in enumerate(nodes)
        ]

    def collect(self) -> None:
        """Every rank's record, once it ended its last pass; ``RuntimeError`` naming a rank
        that failed."""
        self.seen = []
        for process in self.processes:
            out = process.communicate(timeout=DRAIN_S)[0]
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if process.returncode != 0 or not lines or "error" in json.loads(lines[-1]):
                raise RuntimeError(f"a knitkit_job rank failed: {out[-2000:]!r}")
            self.seen.append(json.loads(lines[-1]))
        os.unlink(self.spec_file)

    def waits(self, method: str, record: dict[str, Any]) -> dict[str, float]:
        """Per measured step, the slowest rank's wait (NOTE [ Eager wait across nodes ]) into
        ``record["waits"]``; the median time to the forward-only pass's end as a figure."""
        ends: dict[str, list[float]] = {"old": [], "train": []}
        for minibatch, started in record["starts"].items():
            for name, ended in ends.items():
                at = 2 if name == "old" else 1  # the pass ended / the last micro-batch held
                ended.append(
                    max(s["passes"][f"{minibatch}/{name}"][at] for s in self.seen) - started
                )
        record["waits"] = ends["train"]
        return {f"{method}.forward_pass_s_per_step": statistics.median(ends["old"])}


def _line(stream: IO[str] | None) -> dict[str, Any]:
    assert stream is not None
    line = stream.readline()
    if not line.startswith("{"):
        raise RuntimeError(f"the benchmark's driver stopped: {line!r}")
    out: dict[str, Any] = json.loads(line)
    return out


def run(steps: int, link_mbit: float, methods: list[str]) -> dict[str, float]:
    from knitkit.testing import SimulatedCluster

    config = SimulatedCluster.Config(shm_mb=2048, object_store_mb=1024, ray_cpus=2)
    figures: dict[str, float] = {"steps": steps, "link_mbit": link_mbit, "nodes": NODES}
    tick = os.sysconf("SC_CLK_TCK")
    with SimulatedCluster(NODES, link_cap_mbit=link_mbit, config=config) as cluster:
        addresses = [n.address for n in cluster.nodes]
        argv = [sys.executable, str(Path(__file__).resolve()), "--role", "driver"]
        driver = cluster.node(0).popen(
            [
                *argv,
                "--steps",
                str(steps),
                "--addresses",
                ",".join(addresses),
                "--methods",
                ",".join(methods),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert driver.stdin is not None
        marks: dict[str, dict[str, Any]] = {}
        ranks = _JobRanks(cluster)
        while True:
            record = _line(driver.stdout)
            if "result" in record:
                method = record["result"]
                start, end = marks[f"{method}.start"], marks[f"{method}.end"]
                if "starts" in record:
                    figures.update(ranks.waits(method, record))
                figures.update(_method_figures(method, record, start, end, steps, tick))
                print(f"{method}: done", file=sys.stderr, flush=True)
                continue
            if "done" in record:
                break
            if "mark" in record:
                marks[f"{record['method']}.{record['mark']}"] = _snapshot(cluster)
            elif "ranks" in record:
                ranks.start(record["ranks"], record["nodes"])
            elif "collect" in record:
                ranks.collect()
            driver.stdin.write("ok\n")
            driver.stdin.flush()
        driver.stdin.close()
        driver.wait(120)
    return figures


def _method_figures(
    method: str,
    record: dict[str, Any],
    start: dict[str, Any],
    end: dict[str, Any],
    steps: int,
    tick: int,
) -> dict[str, float]:
    consumed = float(record["consumed"])
    waits = sorted(record["waits"])
    out = {
        f"{method}.exposed_s_per_step": waits[len(waits) // 2],
        f"{method}.bytes_consumed_per_step": consumed / steps,
        f"{method}.driver_rss_bytes": float(record["rss"]),
        f"{method}.driver_rss_growth_bytes": float(record["rss_growth"]),
    }
    cpu = {n: (end["cpu"][n] - start["cpu"][n]) / tick / steps for n in end["cpu"]}
    out[f"{method}.cpu_s_per_step"] = sum(cpu.values())
    for n, seconds in cpu.items():
        out[f"{method}.cpu_s_per_step.node{n}"] = seconds
    total = 0
    for n in end["links"]:
        sent = end["links"][n][0] - start["links"][n][0]
        received = end["links"][n][1] - start["links"][n][1]
        out[f"{method}.link_bytes_per_consumed.node{n}.sent"] = sent / consumed
        out[f"{method}.link_bytes_per_consumed.node{n}.received"] = received / consumed
        total += received
    out[f"{method}.network_bytes_per_consumed"] = total / consumed
    if "placed" in record:  # knitkit_job: what the writer placed, read by two passes
        out[f"{method}.network_bytes_per_placed"] = total / record["placed"]
    prefix = "knitkit/delivery/reorganizer_bytes"
    metrics = record.get("metrics", {})
    if f"{prefix}_whole_remote" in metrics:  # RayBackend reads (NOTE [ Ray unit directory ])
        out[f"{method}.whole_objects_per_consumed"] = metrics[f"{prefix}_whole_remote"] / consumed
        out[f"{method}.reorganizer_read_remote_per_consumed"] = (
            metrics[f"{prefix}_read_remote"] / consumed
        )
    return out


def print_table(figures: dict[str, float]) -> None:
    print(
        f"{figures['nodes']:.0f} simulated nodes, links capped at {figures['link_mbit']:.0f} "
        f"Mbit/s each way; DP2 x CP2 x TP2 + vision DP2, GRPO 8 with images; "
        f"{figures['steps']:.0f} steps"
    )
    print(
        f"{'method':<27}{'MiB/step':>9}{'wait s':>8}{'net/consumed':>14}{'whole objs':>12}"
        f"{'CPU s/step':>12}{'driver RSS MiB':>16}{'RSS growth':>12}"
    )
    for method in METHODS:
        if f"{method}.exposed_s_per_step" not in figures:
            continue
        whole = figures.get(f"{method}.whole_objects_per_consumed", float("nan"))
        print(
            f"{method:<27}{figures[f'{method}.bytes_consumed_per_step'] / 2**20:>9.1f}"
            f"{figures[f'{method}.exposed_s_per_step']:>8.3f}"
            f"{figures[f'{method}.network_bytes_per_consumed']:>14.2f}{whole:>12.2f}"
            f"{figures[f'{method}.cpu_s_per_step']:>12.2f}"
            f"{figures[f'{method}.driver_rss_bytes'] / 2**20:>16.0f}"
            f"{figures[f'{method}.driver_rss_growth_bytes'] / 2**20:>12.1f}"
        )
    print(
        f"load average (1 min) at start / end: {figures['loadavg_1m_at_start']:.1f} / "
        f"{figures['loadavg_1m_at_end']:.1f} on {os.cpu_count()} CPUs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 measured steps instead of 8")
    parser.add_argument("--json", metavar="PATH", help="write the figures as one flat JSON object")
    parser.add_argument("--link-mbit", type=float, default=LINK_MBIT, help="each node's link cap")
    parser.add_argument("--role", default="host", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--addresses", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="the methods to run, comma-separated"
    )
    parser.add_argument("--spec-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "driver":
        _driver(args.steps, args.addresses.split(","), args.methods.split(","))
        return
    if args.role == "rank":
        _rank(args.spec_file, args.rank)
        return
    end_on_sigterm()  # a SIGTERM tears the simulated cluster down, its nodes' processes too
    from knitkit.testing import unavailable_reason

    reason = unavailable_reason(tc=True)
    if reason is not None:
        print(f"skipped: the simulated cluster is unavailable here: {reason}")
        return
    from knitkit.integration.sliced_read import unavailable

    mooncake = unavailable("mooncake")
    skipped = {} if mooncake is None else {"mooncake.skipped": mooncake}
    figures: dict[str, float] = {"loadavg_1m_at_start": os.getloadavg()[0]}
    methods = [m for m in args.methods.split(",") if mooncake is None or "mooncake" not in m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    figures.update(run(3 if args.quick else 8, args.link_mbit, methods))
    finish(figures, print_table, skipped, args.json)


if __name__ == "__main__":
    main()
